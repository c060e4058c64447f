// Package fabric knows what NVSwitch and NVLink5 systems need besides the driver: whether a node
// needs the fabric manager (nv-fabricmanager) and the NVLink subnet manager (nvlsm), the prerequisites
// and the switch-management port they need, the private fabricmanager.cfg the agent writes for
// them, their command lines as daemon specs for the supervisor in package daemon, and, once they
// run, the GPUs' fabric state as nvidia-smi reports it (read until it settles).
package fabric

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// maxConfigSize bounds the fabricmanager.cfg the agent reads.
const maxConfigSize = 1 << 20

// isSettingKey reports whether s, a setting's key in the file, matches ^[A-Za-z0-9_]+$.
func isSettingKey(s string) bool {
	return s != "" && strings.Trim(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") == ""
}

// forced is a setting the agent always writes, with why.
type forced struct {
	key, value, why string
}

// forcedSettings are what the agent needs from fabric manager whatever the overrides say: it
// stays in the foreground under the supervisor, and it logs to stderr (an empty log file name
// sends its log to the console), which the supervisor captures line by line.
func forcedSettings() []forced {
	return []forced{
		{"DAEMONIZE", "0", "the agent runs nv-fabricmanager in the foreground under its supervisor"},
		{"LOG_FILE_NAME", "", "fabric manager logs to stderr, which the agent captures"},
		{"LOG_USE_SYSLOG", "0", "fabric manager logs to stderr, which the agent captures"},
	}
}

// Config is a fabricmanager.cfg kept line by line, so edits keep the order, the comments and
// every line they do not touch byte for byte.
type Config struct {
	lines []cfgLine
	final bool // the text ended with a newline
}

type cfgLine struct {
	text string // without the line ending
	cr   bool   // the line ended with \r\n
	key  string // "" when the line is not a setting
	val  string
}

// ParseConfig reads fabricmanager.cfg's format: KEY=value lines, # comments and blank lines.
// It never fails: a line that is none of these is kept as it is (see Malformed).
func ParseConfig(data []byte) *Config {
	c := &Config{}
	if len(data) == 0 {
		return c
	}
	s := string(data)
	c.final = strings.HasSuffix(s, "\n")
	s = strings.TrimSuffix(s, "\n")
	for _, text := range strings.Split(s, "\n") {
		l := cfgLine{text: text}
		if strings.HasSuffix(text, "\r") {
			l.text, l.cr = strings.TrimSuffix(text, "\r"), true
		}
		l.key, l.val = parseSetting(l.text)
		c.lines = append(c.lines, l)
	}
	return c
}

// parseSetting returns the key and value of a KEY=value line, or "" for anything else.
func parseSetting(text string) (key, val string) {
	t := strings.TrimSpace(text)
	if t == "" || strings.HasPrefix(t, "#") {
		return "", ""
	}
	k, v, ok := strings.Cut(t, "=")
	k = strings.TrimSpace(k)
	if !ok || !isSettingKey(k) {
		return "", ""
	}
	return k, strings.TrimSpace(v)
}

// Get returns the value of key (its first setting) and whether the file sets it.
func (c *Config) Get(key string) (string, bool) {
	for _, l := range c.lines {
		if l.key == key {
			return l.val, true
		}
	}
	return "", false
}

// Keys returns the keys the file sets, in order, each once.
func (c *Config) Keys() []string {
	seen := map[string]bool{}
	var out []string
	for _, l := range c.lines {
		if l.key != "" && !seen[l.key] {
			seen[l.key] = true
			out = append(out, l.key)
		}
	}
	return out
}

// Malformed returns the lines that are neither settings, comments nor blank.
func (c *Config) Malformed() []string {
	var out []string
	for _, l := range c.lines {
		if l.key == "" && strings.TrimSpace(l.text) != "" && !strings.HasPrefix(strings.TrimSpace(l.text), "#") {
			out = append(out, l.text)
		}
	}
	return out
}

// Set replaces every KEY= line of key with KEY=value, in place, and appends one when there is
// none. It reports whether the file had the key. value must be a single line.
func (c *Config) Set(key, value string) bool {
	found := false
	for i := range c.lines {
		if c.lines[i].key == key {
			c.lines[i].text, c.lines[i].val = key+"="+value, strings.TrimSpace(value)
			found = true
		}
	}
	if !found {
		// An appended line ends like the last one, so a CRLF file stays CRLF.
		cr := len(c.lines) > 0 && c.lines[len(c.lines)-1].cr
		c.lines = append(c.lines, cfgLine{text: key + "=" + value, cr: cr, key: key, val: strings.TrimSpace(value)})
		c.final = true
	}
	return found
}

// Bytes renders the file.
func (c *Config) Bytes() []byte {
	var b bytes.Buffer
	for i, l := range c.lines {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(l.text)
		if l.cr {
			b.WriteByte('\r')
		}
	}
	if c.final && len(c.lines) > 0 {
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// Edited is fabricmanager.cfg after the agent's edits.
type Edited struct {
	Data     []byte   // the file to write
	Config   *Config  // the same, parsed
	Warnings []string // overrides that were appended or ignored, lines that were not understood
}

// ValidateOverrides checks NVFM_CONFIG_<KEY>=<value> overrides with config.CheckNVFMOverride. The error wraps
// exitcode.ErrConfig and names each bad one.
func ValidateOverrides(overrides map[string]string) error {
	var errs []error
	for _, k := range sortedKeys(overrides) {
		if err := config.CheckNVFMOverride(k, overrides[k]); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: fabric manager overrides: %w", exitcode.ErrConfig, errors.Join(errs...))
	}
	return nil
}

// EditConfig applies overrides (NVFM_CONFIG_<KEY>=<value>, as KEY -> value) to fabricmanager.cfg
// as key=value edits: an existing KEY= line is replaced where it is, an unknown key is appended
// with a warning. Then the agent's own settings are forced (DAEMONIZE=0, LOG_FILE_NAME= for a log
// on stderr, LOG_USE_SYSLOG=0); an override of one of those is ignored with a warning. Invalid
// overrides are an error and nothing is edited.
func EditConfig(data []byte, overrides map[string]string) (Edited, error) {
	return editConfig(data, overrides, true)
}

func editConfig(data []byte, overrides map[string]string, warnAppended bool) (Edited, error) {
	if err := ValidateOverrides(overrides); err != nil {
		return Edited{}, err
	}
	c := ParseConfig(data)
	var warnings []string
	for _, l := range c.Malformed() {
		warnings = append(warnings, fmt.Sprintf("fabricmanager.cfg: line %q is not KEY=value; kept as it is", l))
	}
	forcedWhy := map[string]forced{}
	for _, f := range forcedSettings() {
		forcedWhy[f.key] = f
	}
	for _, k := range sortedKeys(overrides) {
		v := overrides[k]
		if f, ok := forcedWhy[k]; ok {
			if v != f.value {
				warnings = append(warnings, fmt.Sprintf("NVFM_CONFIG_%s=%s ignored: %s=%s is forced (%s)", k, v, k, f.value, f.why))
			}
			continue
		}
		if !c.Set(k, v) && warnAppended {
			warnings = append(warnings, fmt.Sprintf("NVFM_CONFIG_%s: %s is not in fabricmanager.cfg; appended %s=%s (check the name)", k, k, k, v))
		}
	}
	for _, f := range forcedSettings() {
		c.Set(f.key, f.value)
	}
	out := c.Bytes()
	return Edited{Data: out, Config: ParseConfig(out), Warnings: warnings}, nil
}

// WriteConfig reads fabricmanager.cfg at src, edits it (EditConfig) and writes the result
// atomically to dst through files; src is never changed. A missing src gives a file with only
// the overrides and the forced settings, and a warning.
func WriteConfig(files host.Files, src, dst string, overrides map[string]string) (Edited, error) {
	data, err := kernel.ReadLimit(src, maxConfigSize)
	var missing string
	if errors.Is(err, fs.ErrNotExist) {
		missing = fmt.Sprintf("%s does not exist; writing only the overrides and the agent's settings", src)
		data, err = nil, nil
	}
	if err != nil {
		return Edited{}, err
	}
	ed, err := editConfig(data, overrides, missing == "")
	if err != nil {
		return Edited{}, err
	}
	if missing != "" {
		ed.Warnings = append([]string{missing}, ed.Warnings...)
	}
	if err := files.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return Edited{}, fmt.Errorf("fabric manager config: %w", err)
	}
	if err := files.WriteFile(dst, ed.Data, 0o644, true); err != nil {
		return Edited{}, fmt.Errorf("fabric manager config: %w", err)
	}
	return ed, nil
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
