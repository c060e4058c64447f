module github.com/driver-agent/driver-agent

go 1.26.0

require (
	github.com/klauspost/compress v1.20.4
	github.com/ulikunitz/xz v0.5.17
	go.uber.org/goleak v1.3.0
	golang.org/x/sys v0.50.0
)
