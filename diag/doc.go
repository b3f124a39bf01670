// Package diag holds the rules behind "pdctl diagnose". Each rule looks at
// snapshots taken from a live cluster through package api (queue dumps, step
// records, flight recorders, metrics) and, when it recognises a known fault
// such as the mass-abort wedge, an overlap-schedule desync or the HiCache
// index-K race, reports it by name with its evidence and the remedy.
//
// The code arrives with the pdctl milestone; for now the package holds only
// this description.
package diag
