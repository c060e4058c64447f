// Package images tests what the repository ships besides the agent: Dockerfile.build and
// Dockerfile.precompiled (parsed with BuildKit's own parser, their shell steps run against fake
// tools), and the Kubernetes manifests and gpu-operator Helm values in images/ (decoded into the
// Kubernetes API types with unknown fields rejected, their settings read by the agent's own
// configuration parser).
//
// It is a module of its own so that BuildKit and the Kubernetes API stay out of the agent's
// go.mod; `make images-test` runs it. No Docker engine is needed.
package images
