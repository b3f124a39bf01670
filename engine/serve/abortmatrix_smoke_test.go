//go:build !abortmatrix

package serve

// allAbortCells is false: TestPDAbortEveryStateAndCause runs its smoke
// cells (abortSmoke) only.
const allAbortCells = false
