package exitcode

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

func TestCode(t *testing.T) {
	t.Parallel()
	seen := map[int]bool{}
	for _, e := range Table() {
		if seen[e.Code] {
			t.Errorf("code %d used twice", e.Code)
		}
		seen[e.Code] = true
		if e.Err == nil {
			continue
		}
		wrapped := fmt.Errorf("phase load: %w", fmt.Errorf("nvidia: %w", e.Err))
		if got := Code(wrapped); got != e.Code {
			t.Errorf("Code(%v) = %d, want %d", wrapped, got, e.Code)
		}
	}
	if Code(nil) != 0 || Code(context.Canceled) != 0 || Code(errors.New("boom")) != 1 {
		t.Error("nil, cancel and unclassified errors must map to 0, 0, 1")
	}
	if Code(errors.Join(context.Canceled, ErrInUse)) != 10 {
		t.Error("a classified error wins over cancellation")
	}
	if Code(fmt.Errorf("%w: %w", ErrUnexpected, context.Canceled)) != 1 || Code(errors.Join(ErrUnexpected, ErrBuild)) != 7 {
		t.Error("ErrUnexpected wins over cancellation (exit 1), and loses to any other class")
	}
}
