// Command llmgateway is a toy LLM gateway that limits model tokens per
// minute per tenant, although a response's token count is known only when
// it ends: each request reserves its max_tokens before the model starts,
// streams the response, and settles the reservation with the tokens it
// really produced. The surplus goes back to the tenant's bucket; a response
// that ran past its estimate is charged the excess, into debt if need be.
//
// By default it runs on an embedded Redis (miniredis), so it needs no set-up:
//
//	go run ./examples/llmgateway
//	curl -N -H 'X-Tenant: acme' 'http://127.0.0.1:8081/v1/complete?max_tokens=50&prompt=hello'
//
// -redis ADDR uses a real Redis.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leaselimit/leaselimit"
	"github.com/leaselimit/leaselimit/httplimit"
	"github.com/leaselimit/leaselimit/policy"
	"github.com/redis/go-redis/v9"
)

// tokensPerMinute is each tenant's budget of model tokens.
var tokensPerMinute = policy.Limit{Name: "llm-tokens", Rate: 10_000, Period: time.Minute, Burst: 10_000}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	addr := flag.String("addr", "127.0.0.1:8081", "listen `address`")
	redisAddr := flag.String("redis", "", "Redis `address`; empty starts an embedded Redis (miniredis)")
	flag.Parse()
	if *redisAddr == "" {
		mr, err := miniredis.Run()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer mr.Close()
		*redisAddr = mr.Addr()
	}
	rdb := redis.NewClient(&redis.Options{Addr: *redisAddr})
	defer rdb.Close()
	limits, err := leaselimit.NewClient(rdb)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer limits.Close() // gives back the leased tokens
	srv := &http.Server{Addr: *addr, Handler: gateway(limits.Limiter(tokensPerMinute), echoModel), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
	}()
	fmt.Printf("llmgateway on http://%s/v1/complete (X-Tenant header; max_tokens, prompt)\n", *addr)
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// model streams the response to prompt, at most maxTokens tokens, into
// emit, and returns how many it produced (a real model may produce more
// than asked, or stop early).
type model func(ctx context.Context, prompt string, maxTokens int64, emit func(token string) error) (int64, error)

// gateway serves /v1/complete: it reserves max_tokens of the tenant's
// budget, streams the model's response, and settles the reservation with
// the tokens produced.
func gateway(lim *leaselimit.Limiter, m model) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/complete", func(w http.ResponseWriter, r *http.Request) {
		tenant := r.Header.Get("X-Tenant")
		maxTokens, err := strconv.ParseInt(r.URL.Query().Get("max_tokens"), 10, 64)
		if tenant == "" || err != nil || maxTokens < 1 || maxTokens > tokensPerMinute.Burst {
			http.Error(w, "want an X-Tenant header and 1 <= max_tokens <= "+strconv.FormatInt(tokensPerMinute.Burst, 10), http.StatusBadRequest)
			return
		}
		res, err := lim.Reserve(r.Context(), tenant, maxTokens)
		if err != nil {
			http.Error(w, "rate limiter unavailable", http.StatusServiceUnavailable)
			return
		}
		d := res.Decision()
		httplimit.AddFields(w.Header(), lim, d) // RateLimit-Policy and RateLimit, as httplimit.Middleware sends
		if !d.Allowed {
			httplimit.Refuse(w, d) // 429 with Retry-After and problem+json (503 during an outage)
			return
		}
		flusher, _ := w.(http.Flusher)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		used, err := m(r.Context(), r.URL.Query().Get("prompt"), maxTokens, func(tok string) error {
			if _, err := io.WriteString(w, tok); err != nil {
				return err
			}
			if flusher != nil {
				flusher.Flush()
			}
			return nil
		})
		// Settle even if the client left mid-stream (r.Context() is done
		// then): the tokens produced so far were paid for. Settle does not
		// stop for ctx's cancellation.
		if serr := res.Settle(r.Context(), used); serr != nil {
			fmt.Fprintln(os.Stderr, "llmgateway: settle:", serr)
		}
		if err != nil {
			return
		}
		fmt.Fprintf(w, "\n[%d tokens of %d reserved]\n", used, maxTokens)
	})
	return mux
}

// echoModel is a stand-in for a model: it answers with the prompt's words
// repeated, one token per word, up to maxTokens.
func echoModel(ctx context.Context, prompt string, maxTokens int64, emit func(string) error) (int64, error) {
	words := strings.Fields(prompt)
	if len(words) == 0 {
		words = []string{"…"}
	}
	n := min(int64(len(words))*3, maxTokens)
	for i := int64(0); i < n; i++ {
		if err := ctx.Err(); err != nil {
			return i, err
		}
		if err := emit(words[i%int64(len(words))] + " "); err != nil {
			return i + 1, err
		}
	}
	return n, nil
}
