// Package tui is the Bubble Tea application behind "pdctl top": a live view
// of a cluster's ranks, their steps and phases, the PD queues and any
// divergence between the ranks of a tensor-parallel group. Like the rest of
// pdctl's operator side it reads the cluster only through package api.
//
// The code arrives with the pdctl milestone; for now the package holds only
// this description.
package tui
