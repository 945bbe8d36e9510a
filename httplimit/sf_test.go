package httplimit_test

import (
	"fmt"
	"strconv"
	"strings"
)

// A minimal RFC 9651 List parser, enough to read RateLimit and
// RateLimit-Policy back as a client would: Items whose bare items are
// Strings, Integers, Tokens, Booleans or Byte Sequences, with Parameters.

type sfToken string

type sfByteSeq string

type sfParam struct {
	Key   string
	Value any
}

type sfItem struct {
	Value  any // string, int64, sfToken, bool, sfByteSeq
	Params []sfParam
}

// Param returns the value of the parameter key and whether it is present.
func (it sfItem) Param(key string) (any, bool) {
	for _, p := range it.Params {
		if p.Key == key {
			return p.Value, true
		}
	}
	return nil, false
}

// Int returns the Integer parameter key, failing if it is absent or not an Integer.
func (it sfItem) Int(key string) (int64, error) {
	v, ok := it.Param(key)
	if !ok {
		return 0, fmt.Errorf("parameter %q missing", key)
	}
	n, ok := v.(int64)
	if !ok {
		return 0, fmt.Errorf("parameter %q = %#v, not an Integer", key, v)
	}
	return n, nil
}

// parseSFList parses the field lines of a List field, joined as RFC 9651
// Section 4.2 says (with ", ").
func parseSFList(lines []string) ([]sfItem, error) {
	p := &sfParser{s: strings.Join(lines, ", ")}
	p.skipSP()
	var out []sfItem
	for p.i < len(p.s) {
		it, err := p.item()
		if err != nil {
			return nil, err
		}
		out = append(out, it)
		p.skipOWS()
		if p.i >= len(p.s) {
			return out, nil
		}
		if p.s[p.i] != ',' {
			return nil, p.errf("expected ','")
		}
		p.i++
		p.skipOWS()
		if p.i >= len(p.s) {
			return nil, p.errf("trailing comma")
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

type sfParser struct {
	s string
	i int
}

func (p *sfParser) errf(format string, a ...any) error {
	return fmt.Errorf("sf: at %d of %q: %s", p.i, p.s, fmt.Sprintf(format, a...))
}

func (p *sfParser) skipSP() {
	for p.i < len(p.s) && p.s[p.i] == ' ' {
		p.i++
	}
}

func (p *sfParser) skipOWS() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t') {
		p.i++
	}
}

func (p *sfParser) item() (sfItem, error) {
	v, err := p.bare()
	if err != nil {
		return sfItem{}, err
	}
	it := sfItem{Value: v}
	for p.i < len(p.s) && p.s[p.i] == ';' {
		p.i++
		p.skipSP()
		k, err := p.key()
		if err != nil {
			return sfItem{}, err
		}
		var pv any = true
		if p.i < len(p.s) && p.s[p.i] == '=' {
			p.i++
			if pv, err = p.bare(); err != nil {
				return sfItem{}, err
			}
		}
		for _, q := range it.Params {
			if q.Key == k {
				return sfItem{}, p.errf("duplicate parameter %q", k)
			}
		}
		it.Params = append(it.Params, sfParam{k, pv})
	}
	return it, nil
}

func (p *sfParser) key() (string, error) {
	start := p.i
	if p.i >= len(p.s) || !(p.s[p.i] >= 'a' && p.s[p.i] <= 'z' || p.s[p.i] == '*') {
		return "", p.errf("bad key")
	}
	for p.i < len(p.s) && strings.IndexByte("abcdefghijklmnopqrstuvwxyz0123456789_-.*", p.s[p.i]) >= 0 {
		p.i++
	}
	return p.s[start:p.i], nil
}

func (p *sfParser) bare() (any, error) {
	if p.i >= len(p.s) {
		return nil, p.errf("missing bare item")
	}
	switch c := p.s[p.i]; {
	case c == '-' || c >= '0' && c <= '9':
		start := p.i
		p.i++
		for p.i < len(p.s) && p.s[p.i] >= '0' && p.s[p.i] <= '9' {
			p.i++
		}
		if p.i < len(p.s) && p.s[p.i] == '.' {
			return nil, p.errf("decimals not supported here")
		}
		digits := strings.TrimPrefix(p.s[start:p.i], "-")
		if len(digits) == 0 || len(digits) > 15 {
			return nil, p.errf("bad integer")
		}
		return strconv.ParseInt(p.s[start:p.i], 10, 64)
	case c == '"':
		var b strings.Builder
		for p.i++; ; p.i++ {
			if p.i >= len(p.s) {
				return nil, p.errf("unterminated string")
			}
			c := p.s[p.i]
			switch {
			case c == '\\':
				p.i++
				if p.i >= len(p.s) || (p.s[p.i] != '"' && p.s[p.i] != '\\') {
					return nil, p.errf("bad escape")
				}
				b.WriteByte(p.s[p.i])
			case c == '"':
				p.i++
				return b.String(), nil
			case c < 0x20 || c > 0x7e:
				return nil, p.errf("non-printable byte in string")
			default:
				b.WriteByte(c)
			}
		}
	case c == '?':
		if p.i+1 < len(p.s) && (p.s[p.i+1] == '0' || p.s[p.i+1] == '1') {
			p.i += 2
			return p.s[p.i-1] == '1', nil
		}
		return nil, p.errf("bad boolean")
	case c == ':':
		end := strings.IndexByte(p.s[p.i+1:], ':')
		if end < 0 {
			return nil, p.errf("unterminated byte sequence")
		}
		v := p.s[p.i+1 : p.i+1+end]
		p.i += end + 2
		return sfByteSeq(v), nil
	case c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '*':
		start := p.i
		for p.i < len(p.s) && (strings.IndexByte(":/!#$%&'*+-.^_`|~", p.s[p.i]) >= 0 ||
			p.s[p.i] >= 'a' && p.s[p.i] <= 'z' || p.s[p.i] >= 'A' && p.s[p.i] <= 'Z' || p.s[p.i] >= '0' && p.s[p.i] <= '9') {
			p.i++
		}
		return sfToken(p.s[start:p.i]), nil
	}
	return nil, p.errf("unexpected %q", p.s[p.i])
}
