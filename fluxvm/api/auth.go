package api

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"strings"
)

// level is what a caller may do.
type level int

const (
	levelNone  level = iota // no valid token
	levelRead               // GET routes
	levelAdmin              // every route
)

// authenticator checks bearer tokens. It keeps only SHA-256 digests of the
// tokens, so comparisons take the same time whatever a token's length.
type authenticator struct {
	tokens []tokenDigest
}

type tokenDigest struct {
	sum   [sha256.Size]byte
	level level
}

func newAuthenticator(admin, read []string) (*authenticator, error) {
	if len(admin) == 0 && len(read) == 0 {
		return nil, errors.New("no token configured: at least one admin or read token is required")
	}
	a := &authenticator{}
	seen := make(map[[sha256.Size]byte]string)
	add := func(kind string, lvl level, list []string) error {
		for i, tok := range list {
			if err := checkToken(tok); err != nil {
				return fmt.Errorf("%s token %d: %w", kind, i, err)
			}
			sum := sha256.Sum256([]byte(tok))
			if prev, dup := seen[sum]; dup {
				if prev != kind {
					return fmt.Errorf("%s token %d is also configured as %s token", kind, i, prev)
				}
				continue
			}
			seen[sum] = kind
			a.tokens = append(a.tokens, tokenDigest{sum: sum, level: lvl})
		}
		return nil
	}
	if err := add("admin", levelAdmin, admin); err != nil {
		return nil, err
	}
	if err := add("read", levelRead, read); err != nil {
		return nil, err
	}
	return a, nil
}

// checkToken rejects tokens that no Authorization header could carry.
func checkToken(tok string) error {
	if tok == "" {
		return errors.New("empty")
	}
	for i := 0; i < len(tok); i++ {
		if c := tok[i]; c <= ' ' || c >= 0x7f {
			return errors.New("contains whitespace, a control or a non-ASCII character")
		}
	}
	return nil
}

// authenticate returns the level of the token in an Authorization header
// value ("Bearer <token>", scheme case-insensitive). It hashes the
// presented token and compares it with every configured digest without
// stopping at a match.
func (a *authenticator) authenticate(header string) level {
	scheme, tok, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return levelNone
	}
	tok = strings.TrimLeft(tok, " ")
	if tok == "" {
		return levelNone
	}
	sum := sha256.Sum256([]byte(tok))
	found := int(levelNone)
	for i := range a.tokens {
		eq := subtle.ConstantTimeCompare(sum[:], a.tokens[i].sum[:])
		found = subtle.ConstantTimeSelect(eq, int(a.tokens[i].level), found)
	}
	return level(found)
}
