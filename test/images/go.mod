module github.com/driver-agent/driver-agent/test/images

go 1.26.8

require (
	github.com/moby/buildkit v0.34.2 // indirect
	go.yaml.in/yaml/v2 v2.4.4 // indirect
	k8s.io/api v0.37.2 // indirect
	k8s.io/apimachinery v0.37.2 // indirect
	sigs.k8s.io/yaml v1.6.0 // indirect
)
