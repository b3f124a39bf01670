//go:build abortmatrix

package serve

// allAbortCells runs every cell of TestPDAbortEveryStateAndCause.
const allAbortCells = true
