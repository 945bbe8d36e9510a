package leaselimit

import "github.com/leaselimit/leaselimit/internal/version"

// Version is this module's version (semantic versioning): the release this
// source is, or the next one with a -dev suffix between releases. It is
// also the OpenTelemetry instrumentation scope's version. Before v1, a
// minor release may change the API; CHANGELOG.md says what changed.
const Version = version.Version
