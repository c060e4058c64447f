# driver-agent: build, test, lint. `make ci` is what .ci/run and the README's test command run.
GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
PKG       := github.com/driver-agent/driver-agent
LDFLAGS   := -s -w -X $(PKG)/pkg/cli.version=$(VERSION)
BIN       := bin
STATICCHECK_VERSION := v0.8.2
ACTIONLINT_VERSION  := v1.7.12
FUZZTIME  ?= 20s

.PHONY: all build test lint fmt vet staticcheck actionlint images-test images-lint image-test fuzz vm-test vm-bench nvidia-test nvidia-bench vm-deps deps ci clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/driver-agent ./cmd/driver-agent
	ln -sf driver-agent $(BIN)/nvidia-driver

test:
	$(GO) test -race -shuffle=on -count=1 ./...

fmt:
	@out=$$(gofmt -l cmd pkg scripts test 2>/dev/null); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...
	$(GO) vet -tags 'vmtest vmbench' ./test/vm/
	$(GO) vet -tags 'vmtest nvidiatest' ./test/vm/

staticcheck:
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) -tags 'vmtest vmbench' ./test/vm/
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) -tags 'vmtest nvidiatest' ./test/vm/

# The workflows in .github/workflows (with shellcheck on their run: scripts when it is installed)
actionlint:
	$(GO) run github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

# test/images is its own module (the Dockerfile parser and the Kubernetes API types stay out of
# the main module): the Dockerfiles, the manifests and Helm values in images/.
images-test:
	cd test/images && $(GO) test -count=1 ./...

# Dockerfile.build built with buildah (vfs storage, chroot isolation, as root) from a Debian base
# made by mmdebstrap, NVIDIA's downloads served from 127.0.0.1 (a makeself .run of Debian's NVIDIA
# 535 sources and userspace, a signed apt repository of stand-in fabric manager packages); the
# image is checked and its root left in $(DRIVER_AGENT_IMAGE_WORK)/rootfs.ext4 for the VM's
# container scenarios (TestContainer, run by vm-test). The NVIDIA sources are downloaded into
# $(DRIVER_AGENT_NVIDIA_SOURCES)/<this machine's suite>, where nvidia-test reads them. See
# test/vm/README.md.
DRIVER_AGENT_IMAGE_WORK ?= /var/tmp/driver-agent-image
image-test:
	DRIVER_AGENT_IMAGE_WORK=$(DRIVER_AGENT_IMAGE_WORK) DRIVER_AGENT_NVIDIA_SOURCES=$(DRIVER_AGENT_NVIDIA_SOURCES) bash scripts/image-test.sh

images-lint:
	cd test/images && $(GO) vet ./... && $(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

lint: fmt vet staticcheck actionlint images-lint

# Short runs of every fuzz target; longer runs: make fuzz FUZZTIME=10m
fuzz:
	@set -e; for pkg in $$($(GO) list ./...); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz' || true); do \
	    echo "fuzz $$pkg $$f"; $(GO) test -run=NONE -fuzz="^$$f$$" -fuzztime=$(FUZZTIME) -fuzzminimizetime=5s $$pkg; \
	  done; done

vm-test:
	$(GO) test -tags vmtest -v -count=1 -timeout 40m ./test/vm/

# Figures, not a test: the agent's time to Ready, teardown and peak RSS in the VM against busybox
# scripts doing the same insmods and mknods (test/vm/README.md). DRIVER_AGENT_VM_BENCH_RUNS=N.
vm-bench:
	$(GO) test -tags 'vmtest vmbench' -run '^TestVMBench$$' -v -count=1 -timeout 30m ./test/vm/

# NVIDIA's real drivers (Debian's nvidia-kernel-source and nvidia-open-kernel-source of each VM
# kernel's suite: this machine's, 535 for 6.1, and trixie's, 550 for 6.12, downloaded into
# DRIVER_AGENT_NVIDIA_SOURCES/<suite> by scripts/nvidia-sources.sh, trixie's checked against its
# 6.12 headers): the compile path, driver-agent build, and the load in a VM of each kernel, which
# fails with ENODEV for want of a GPU (test/vm/README.md). Needs what vm-test needs, and network.
# (Not NVIDIA_SOURCES: make exports command-line variables, and NVIDIA's Kbuild appends its source
# list to a variable of that name.)
# make nvidia-bench is the same stage plus a bare make of the same tree, timed against the
# agent's build (more full NVIDIA builds, so not part of make ci).
DRIVER_AGENT_NVIDIA_SOURCES ?= /tmp/driver-agent-nvidia-sources
VM_CACHE   = $(or $(DRIVER_AGENT_VM_CACHE),/var/cache/driver-agent-vm)
HOST_SUITE = $(shell . /etc/os-release && echo $$VERSION_CODENAME)
nvidia-test:
	@t0=$$(date +%s); bash scripts/nvidia-sources.sh $(DRIVER_AGENT_NVIDIA_SOURCES)/$(HOST_SUITE) $(HOST_SUITE) && \
	  bash scripts/nvidia-sources.sh $(DRIVER_AGENT_NVIDIA_SOURCES)/trixie trixie $(VM_CACHE)/trixie/headers && \
	  echo "$@: NVIDIA sources in $(DRIVER_AGENT_NVIDIA_SOURCES) after $$(( $$(date +%s) - t0 )) s"
	DRIVER_AGENT_NVIDIA_SOURCES=$(DRIVER_AGENT_NVIDIA_SOURCES) $(GO) test -tags 'vmtest nvidiatest' -run '^TestNVIDIA$$' -v -count=1 -timeout 80m ./test/vm/

nvidia-bench:
	$(MAKE) nvidia-test DRIVER_AGENT_NVIDIA_BENCH=1

deps:
	bash scripts/install-deps.sh

# qemu, busybox, the kernel headers and the matching kernel image for the VM tests, and trixie's
# 6.12 kernel, headers and gcc 14 (as root)
vm-deps:
	bash scripts/vm-deps.sh

ci: deps vm-deps lint test images-test build image-test vm-test nvidia-test

clean:
	rm -rf $(BIN)
