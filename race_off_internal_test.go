//go:build !race

package leaselimit

// raceDetector reports whether the tests run under the race detector.
const raceDetector = false
