package policy

// What the external tests (package policy_test) use and users do not get.

// MaxNameLen is the longest Limit.Name accepted.
const MaxNameLen = maxNameLen

// ValidateName is validateName.
var ValidateName = validateName
