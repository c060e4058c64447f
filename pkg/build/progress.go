package build

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ProgressMessage is the message of the build's progress log records.
const ProgressMessage = "Building kernel modules:"

// barWidth is the number of '#' of a full progress bar.
const barWidth = 40

// space is the set of bytes of regexp's \s.
const space = "\t\n\f\r "

// compiledObject returns the object of kbuild's line for one compiled object in its default
// (quiet) output, "  CC [M]  /path/to/nvidia/nv.o": group 1 of ^\s*CC \[M\]\s+(\S+).
func compiledObject(line string) (string, bool) {
	rest, ok := strings.CutPrefix(strings.TrimLeft(line, space), "CC [M]")
	obj := strings.TrimLeft(rest, space)
	if !ok || len(obj) == len(rest) {
		return "", false
	}
	if i := strings.IndexAny(obj, space); i >= 0 {
		obj = obj[:i]
	}
	return obj, obj != ""
}

// isConftest reports whether line, a line of NVIDIA's configuration tests (" CONFTEST: drm/drm_drv.h"),
// matches ^\s*CONFTEST: . They run before the first object is compiled and take a good part of the build.
func isConftest(line string) bool {
	return strings.HasPrefix(strings.TrimLeft(line, space), "CONFTEST: ")
}

// countSources returns the number of C sources the kbuild run will compile
// for modules: every word ending in ".c" in the modules' *.Kbuild files
// (comments removed) that names a file in srcDir, counted once. NVIDIA lists
// its sources that way (NVIDIA_SOURCES += nvidia/nv.c, ...). A source listed
// but filtered out later in the Kbuild file is counted too; the bar then
// stops short of 100% until the build succeeds.
func countSources(srcDir string, modules []string) (int, error) {
	seen := map[string]bool{}
	for _, m := range modules {
		files, err := filepath.Glob(filepath.Join(srcDir, m, "*.Kbuild"))
		if err != nil {
			return 0, err
		}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				return 0, err
			}
			for _, line := range strings.Split(string(b), "\n") {
				line, _, _ = strings.Cut(line, "#")
				for _, w := range strings.FieldsFunc(line, func(r rune) bool {
					return r == ' ' || r == '\t' || r == '=' || r == ':' || r == '+' || r == '(' || r == ')' || r == '\\'
				}) {
					if !strings.HasSuffix(w, ".c") || !filepath.IsLocal(w) || seen[w] {
						continue
					}
					st, err := os.Stat(filepath.Join(srcDir, w))
					switch {
					case err == nil:
						if st.Mode().IsRegular() {
							seen[w] = true
						}
					case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
					default:
						return 0, err
					}
				}
			}
		}
	}
	return len(seen), nil
}

// progress follows a build's output: it copies it to the log file, counts
// compiled objects against the expected total, draws a bar on a terminal
// and logs at a steady interval.
type progress struct {
	total int
	log   *slog.Logger
	term  io.Writer

	mu        sync.Mutex
	conftests int
	compiled  map[string]bool
	drawn     string // the bar last drawn on term
	final     bool
}

func newProgress(total int, log *slog.Logger, term io.Writer) *progress {
	return &progress{total: max(total, 1), log: log, term: term, compiled: map[string]bool{}}
}

// follow copies r to logFile line by line, counting compiled objects, until
// r ends. It returns the first error writing the log.
func (p *progress) follow(r io.Reader, logFile io.Writer) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var werr error
	for {
		line, err := br.ReadString('\n')
		if line != "" {
			if werr == nil {
				_, werr = io.WriteString(logFile, line)
			}
			if obj, ok := compiledObject(line); ok {
				p.add(obj)
			} else if isConftest(line) {
				p.mu.Lock()
				p.conftests++
				p.mu.Unlock()
			}
		}
		if err != nil {
			return werr
		}
	}
}

func (p *progress) add(object string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.final || p.compiled[object] {
		return
	}
	p.compiled[object] = true
	if len(p.compiled) > p.total {
		p.total = len(p.compiled) // more objects than counted: never above 100%
	}
	p.drawLocked()
}

// percent is the share of compiled objects; it reaches 100 only through
// finish, when the build has succeeded.
func (p *progress) percentLocked() int {
	if p.final {
		return 100
	}
	return min(99, len(p.compiled)*100/p.total)
}

// bar renders "[####    ]  45%".
func renderBar(percent int) string {
	n := percent * barWidth / 100
	return fmt.Sprintf("[%s%s] %3d%%", strings.Repeat("#", n), strings.Repeat(" ", barWidth-n), percent)
}

func (p *progress) drawLocked() {
	if p.term == nil {
		return
	}
	bar := renderBar(p.percentLocked())
	if bar == p.drawn {
		return
	}
	p.drawn = bar
	fmt.Fprintf(p.term, "\r%s %s", ProgressMessage, bar)
	if p.final {
		fmt.Fprintln(p.term)
	}
}

// logNow writes one progress record.
func (p *progress) logNow() {
	p.mu.Lock()
	pct, done, total, conftests := p.percentLocked(), len(p.compiled), p.total, p.conftests
	if p.final {
		done = total
	}
	p.mu.Unlock()
	attrs := []any{"progress", renderBar(pct), "percent", pct, "objects", done, "total", total}
	if conftests > 0 {
		attrs = append(attrs, "conftests", conftests) // NVIDIA's configuration tests, before the objects
	}
	p.log.Info(ProgressMessage, attrs...)
}

// start logs the first record and then one every interval until stop is called.
func (p *progress) start(interval time.Duration) (stop func()) {
	p.logNow()
	quit := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				p.logNow()
			case <-quit:
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			<-done
		})
	}
}

// finish marks the build complete: the bar is drawn full and logged at 100%.
func (p *progress) finish() {
	p.mu.Lock()
	p.final = true
	p.drawLocked()
	p.mu.Unlock()
	p.logNow()
}

// abort ends the terminal line of an unfinished bar.
func (p *progress) abort() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.term != nil && p.drawn != "" && !p.final {
		fmt.Fprintln(p.term)
	}
}
