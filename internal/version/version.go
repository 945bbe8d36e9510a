// Package version holds the module's version, for leaselimit.Version and
// the OpenTelemetry instrumentation scope (telemetry.Version), which the
// root package cannot share directly (it imports telemetry).
package version

// Version is the leaselimit module's version: the release this source is,
// or the next one with a -dev suffix between releases. CHANGELOG.md lists
// what each release changed.
const Version = "0.2.0-dev"
