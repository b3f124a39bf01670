# pdkit's build entry points. `make` alone lists the targets.

GO ?= go
GOFMT ?= $(shell $(GO) env GOROOT)/bin/gofmt

# Flags for `make test`: the whole suite must finish within 15 minutes on 2 cores.
GOTESTFLAGS ?= -race -timeout 14m
# How long each kernel benchmark runs in `make bench`.
BENCHTIME ?= 1s
# How long make test runs each fuzz target (the GGUF reader, the model loader).
FUZZTIME ?= 10s
# Flags for `bin/pdserve launch` in `make run`.
ARGS ?=
# How long `make soak` loads the cluster, and the go test timeout around it.
SOAK_DURATION ?= 10m
SOAK_TIMEOUT ?= 30m
# Stamped into the binaries' version variable.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS ?= -X main.version=$(VERSION)
# go-nvml's header declares functions deprecated by NVML 13; its cgo
# prologue would warn for each one on every fresh build.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

.DEFAULT_GOAL := help
.PHONY: help deps build run test soak bench check cuda-check clean

help: ## list the targets and the variables they read
	@echo 'usage: make TARGET [VAR=value ...]'
	@echo
	@awk 'BEGIN { FS = ":.*## " } /^[a-z][a-z-]*:.*## / { printf "  %-11s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
	@echo
	@echo 'variables: GO, GOTESTFLAGS (test), BENCHTIME (bench), ARGS (run: pdserve launch flags), VERSION (build),'
	@echo '           SOAK_DURATION and SOAK_TIMEOUT (soak)'

deps: ## install missing system packages (apt) and Go modules; needs Go already
	@GO='$(GO)' sh scripts/deps.sh

build: ## build bin/pdserve and bin/pdctl
	$(GO) build -ldflags '$(LDFLAGS)' -o bin/pdserve ./cmd/pdserve
	$(GO) build -ldflags '$(LDFLAGS)' -o bin/pdctl ./cmd/pdctl

run: deps build ## a PD cluster on loopback (router on :8000, one prefill, one decode) with the built-in model; ARGS="..." adds launch flags
	bin/pdserve launch $(ARGS)

test: deps ## go vet, the whole test suite with the race detector, the multi-host, network-fault and starved-decode tests (as root), the GGUF reader's and the model loader's fuzz targets for FUZZTIME (10s) each, the deploy module's (Kubernetes manifests)
	$(GO) vet ./...
	$(GO) test $(GOTESTFLAGS) ./...
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./engine/gguf/
	$(GO) test -run '^$$' -fuzz '^FuzzLoad$$' -fuzztime $(FUZZTIME) ./engine/model/
	$(GO) test -tags netns -run '^(TestMultiHost|TestDiagnoseNetworkFaults|TestDiagnoseStarvedDecode)$$' ./internal/clustertest/
	cd deploy && $(GO) vet ./... && $(GO) test ./...

soak: deps ## make run's cluster under 60 greedy sessions for SOAK_DURATION (10m): outputs against references, pdctl diagnose every 30s, RSS and goroutines flat
	$(GO) test -tags soak -run '^TestSoak$$' -v -timeout $(SOAK_TIMEOUT) ./internal/soak/ -args -soak.duration=$(SOAK_DURATION)

bench: deps build ## kernel micro-benchmarks, the model benchmark on the built-in small and medium models (bin/pdserve bench; medium with one run per figure instead of three, about a minute), the serving one (bin/pdserve bench serve), the overlap loop against lock-step on it at every CPU and one thread, interleaved (bin/pdserve bench overlap), PD vs colocated TTFT and the KV transport against raw TCP (bin/pdserve bench pd), 200 sessions at once through a real PD cluster (bin/pdserve bench load), the HiCache index-K race, host hits against recompute and the three write policies side by side (bin/pdserve bench hicache, 300 requests per cell), then the PD wire codec, the ZeroMQ transport against raw loopback TCP, and a chat template rendered in its sandbox against in the process
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) ./kernels/...
	bin/pdserve bench
	bin/pdserve bench --size medium --repeats 1
	bin/pdserve bench serve
	bin/pdserve bench overlap
	bin/pdserve bench pd
	bin/pdserve bench load
	bin/pdserve bench hicache --requests-per-cell 300
	$(GO) test -run '^$$' -bench . -benchmem ./api/pdproto/ ./engine/pd/zmqlink/ ./engine/chattemplate/

check: deps ## fail on unformatted files, go vet findings or a go.mod that go mod tidy would change
	@files=$$(find . -name '*.go' -not -path './.git/*' -not -path './bin/*' -not -path '*/testdata/*' \
		-exec '$(GOFMT)' -l {} +) || exit 1; \
	if [ -n "$$files" ]; then echo 'gofmt would change these files:'; echo "$$files"; exit 1; fi
	$(GO) vet ./...
	$(GO) mod tidy -diff

# The fetched CUDA headers are added to CGO_CFLAGS and CGO_LDFLAGS, never put
# in their place. -isystem makes them system headers, whose own warnings the
# compiler keeps quiet, and -Wno-deprecated-declarations stays, so the calls
# of cgo wrappers to what NVML and CUDA deprecate stay quiet too.
cuda-check: deps ## compile (never run) the -tags cuda build against fetched CUDA headers (added to CGO_CFLAGS and CGO_LDFLAGS)
	@dir=$$(sh scripts/cuda-headers.sh) && \
	export CGO_CFLAGS="$$CGO_CFLAGS -isystem $$dir/include -Wno-deprecated-declarations" \
		CGO_LDFLAGS="$${CGO_LDFLAGS:+$$CGO_LDFLAGS }-L$$dir/lib" && \
	echo "CGO_CFLAGS=\"$$CGO_CFLAGS\" CGO_LDFLAGS=\"$$CGO_LDFLAGS\"" && \
	echo "$(GO) vet -tags cuda ./..." && $(GO) vet -tags cuda ./... && \
	echo "$(GO) build -tags cuda ./..." && $(GO) build -tags cuda ./...

clean: ## remove bin/
	rm -rf bin/
