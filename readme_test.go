package leaselimit_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readmeSources are the files the README's Go snippets are taken from:
// each is compiled by `go vet` and run by the tests of its module, so a
// snippet found in one of them compiles against the API as it is.
var readmeSources = []string{
	"examples/quickstart/main.go",
	"readme_example_test.go",
	"grpclimit/readme_example_test.go",
}

// TestREADMESnippetsCompile keeps the README honest: every ```go block in
// it must appear, line for line (blanks and blank lines aside), in one
// of readmeSources. A snippet edited in the README alone, or an API change
// that its source no longer compiles against, fails here or in the build.
func TestREADMESnippetsCompile(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var sources []string
	for _, f := range readmeSources {
		b, err := os.ReadFile(filepath.FromSlash(f))
		if err != nil {
			t.Fatalf("README snippet source: %v", err)
		}
		sources = append(sources, "\n"+strings.Join(snippetLines(string(b)), "\n")+"\n")
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	if len(blocks) < 8 {
		t.Fatalf("README has %d Go snippets; expected the quick start, the API screen and a recipe each for plans, several limits, quotas, costs afterwards, HTTP and gRPC", len(blocks))
	}
	for _, b := range blocks {
		want := "\n" + strings.Join(snippetLines(b[1]), "\n") + "\n"
		found := false
		for _, s := range sources {
			if strings.Contains(s, want) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("README snippet not found in any of %v (keep it there, compiled, and copy it from there):\n%s", readmeSources, b[1])
		}
	}
}

// snippetLines returns the lines of s with their runs of blanks made one
// space (gofmt aligns comments by the lines around them), blank lines
// dropped.
func snippetLines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.Join(strings.Fields(l), " "); l != "" {
			out = append(out, l)
		}
	}
	return out
}
