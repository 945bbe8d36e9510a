package main

import (
	"slices"
	"testing"
)

// TestRoundOrderIsBalanced: over a full cycle of rounds (n, or 2n for an
// odd n), every round runs each design once, every design runs first
// equally often, and every design follows each other one equally often,
// so that no design always pays for the same predecessor's deferred work.
func TestRoundOrderIsBalanced(t *testing.T) {
	for n := 1; n <= 9; n++ {
		cycle := n
		if n%2 == 1 {
			cycle = 2 * n
		}
		first := make([]int, n)
		follows := make(map[[2]int]int) // {before, after} -> rounds
		for r := range cycle {
			order := roundOrder(n, r)
			sorted := slices.Sorted(slices.Values(order))
			for i, d := range sorted {
				if d != i {
					t.Fatalf("n=%d round %d: order %v is not a permutation of the designs", n, r, order)
				}
			}
			first[order[0]]++
			for i := 1; i < n; i++ {
				follows[[2]int{order[i-1], order[i]}]++
			}
		}
		for d, c := range first {
			if c != cycle/n {
				t.Errorf("n=%d: design %d ran first in %d of %d rounds, want %d", n, d, c, cycle, cycle/n)
			}
		}
		if n < 2 {
			continue
		}
		// (n-1)*cycle adjacent pairs, spread over the n*(n-1) ordered
		// pairs of designs.
		want := cycle / n
		for a := range n {
			for b := range n {
				if a == b {
					continue
				}
				if c := follows[[2]int{a, b}]; c != want {
					t.Errorf("n=%d: design %d followed design %d in %d rounds of %d, want %d", n, b, a, c, cycle, want)
				}
			}
		}
	}
}
