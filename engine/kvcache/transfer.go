package kvcache

import (
	"encoding/binary"
	"fmt"
	"math"
	"unsafe"

	"github.com/pdkit/pdkit/kernels"
)

// Moving KV between pools of two processes (PD disaggregation): the sender
// appends the rows of some slots as bytes, the receiver puts them into its
// own slots. K and V rows are the stored elements, KVDim per token (a
// latent pool's rows are K rows only, and its V bytes are empty):
// little-endian float32 in an F32 pool, the little-endian 16-bit codes in a
// BF16 or F16 pool (half the bytes);
// index-K rows are the stored codes (one byte per element for fp8, two
// little-endian bytes for bf16) and, for fp8, one little-endian float32
// scale per token. Both pools must have the same KV shape, KV type and
// index-K precision; Put refuses bytes of the wrong size (the peers agree
// on the types before any row moves: api/pdproto's bootstrap).

// AppendKV appends the K and V rows of slots in layer to k and v.
func (p *Pool) AppendKV(layer int, slots []int32, k, v []byte) ([]byte, []byte) {
	d, vd := p.cfg.KVDim, p.cfg.VDim()
	for i := 0; i < len(slots); {
		n := run(slots[i:])
		off, voff := int(slots[i])*d, int(slots[i])*vd
		if p.k != nil {
			k = appendF32(k, p.k[layer][off:off+n*d])
			v = appendF32(v, p.v[layer][voff:voff+n*vd])
		} else {
			k = appendU16(k, p.k16[layer][off:off+n*d])
			v = appendU16(v, p.v16[layer][voff:voff+n*vd])
		}
		i += n
	}
	return k, v
}

// run is the length of the run of consecutive slots that starts slots (a
// page's slots are one run): rows of consecutive slots are contiguous, so
// a run is copied at once.
func run(slots []int32) int {
	n := 1
	for n < len(slots) && slots[n] == slots[n-1]+1 {
		n++
	}
	return n
}

// AppendIndexK appends the index-K rows of slots in layer to rows, and for
// fp8 their scales to scales. A pool without an indexer appends nothing.
func (p *Pool) AppendIndexK(layer int, slots []int32, rows, scales []byte) ([]byte, []byte) {
	if p.idx == nil {
		return rows, scales
	}
	ik := p.idx[layer]
	d := ik.Dim
	for _, s := range slots {
		off := int(s) * d
		switch ik.DType {
		case kernels.IndexFP8:
			rows = append(rows, ik.FP8[off:off+d]...)
			scales = binary.LittleEndian.AppendUint32(scales, math.Float32bits(ik.Scales[s]))
		case kernels.IndexBF16:
			rows = appendU16(rows, ik.BF16[off:off+d])
		}
	}
	return rows, scales
}

// PutKV writes K and V rows, as AppendKV wrote them, into slots of layer.
// Each slot must lie on a page the caller's sequence alone holds.
func (p *Pool) PutKV(layer int, slots []int32, k, v []byte) error {
	return p.putKV(layer, slots, k, v, "PutKV")
}

// FillKV is PutKV for a host-tier loader filling pages the prefix cache
// holds (AllocCached) while readers wait at a gate for them: it may run off
// the pool's loop, so it reads none of the pool's holder bookkeeping and
// checks only that each slot is in range.
func (p *Pool) FillKV(layer int, slots []int32, k, v []byte) error {
	return p.putKV(layer, slots, k, v, "")
}

// putKV checks each slot's holders under op's name (none when op is empty).
func (p *Pool) putKV(layer int, slots []int32, k, v []byte, op string) error {
	d, rb := p.cfg.KVDim, p.cfg.KVRowBytes()
	vd, vrb := p.cfg.VDim(), p.cfg.VRowBytes()
	if len(k) != len(slots)*rb || len(v) != len(slots)*vrb {
		return fmt.Errorf("kvcache: put %s KV of layer %d: %d K and %d V bytes for %d tokens of %d and %d bytes",
			kernels.KVName(p.cfg.KVType), layer, len(k), len(v), len(slots), rb, vrb)
	}
	if err := p.checkSlots(slots); err != nil {
		return fmt.Errorf("kvcache: put KV of layer %d: %w", layer, err)
	}
	if invariants && op != "" {
		for _, s := range slots {
			p.checkSlot(op, s)
		}
	}
	for i := 0; i < len(slots); {
		n := run(slots[i:])
		off, voff := int(slots[i])*d, int(slots[i])*vd
		if p.k != nil {
			getF32(p.k[layer][off:off+n*d], k[i*rb:])
			getF32(p.v[layer][voff:voff+n*vd], v[i*vrb:])
		} else {
			getU16(p.k16[layer][off:off+n*d], k[i*rb:])
			getU16(p.v16[layer][voff:voff+n*vd], v[i*vrb:])
		}
		i += n
	}
	return nil
}

// PutIndexK writes index-K rows and scales, as AppendIndexK wrote them,
// into slots of layer.
func (p *Pool) PutIndexK(layer int, slots []int32, rows, scales []byte) error {
	return p.putIndexK(layer, slots, rows, scales, "PutIndexK")
}

// FillIndexK is PutIndexK for a host-tier loader, as FillKV is PutKV.
func (p *Pool) FillIndexK(layer int, slots []int32, rows, scales []byte) error {
	return p.putIndexK(layer, slots, rows, scales, "")
}

func (p *Pool) putIndexK(layer int, slots []int32, rows, scales []byte, op string) error {
	if p.idx == nil {
		if len(rows) != 0 || len(scales) != 0 {
			return fmt.Errorf("kvcache: put index-K of layer %d: the pool has no indexer", layer)
		}
		return nil
	}
	ik := p.idx[layer]
	d := ik.Dim
	n := len(slots)
	switch ik.DType {
	case kernels.IndexFP8:
		if len(rows) != n*d || len(scales) != n*4 {
			return fmt.Errorf("kvcache: put fp8 index-K of layer %d: %d row and %d scale bytes for %d tokens of %d", layer, len(rows), len(scales), n, d)
		}
	case kernels.IndexBF16:
		if len(rows) != n*d*2 || len(scales) != 0 {
			return fmt.Errorf("kvcache: put bf16 index-K of layer %d: %d row and %d scale bytes for %d tokens of %d", layer, len(rows), len(scales), n, d)
		}
	}
	if err := p.checkSlots(slots); err != nil {
		return fmt.Errorf("kvcache: put index-K of layer %d: %w", layer, err)
	}
	for i, s := range slots {
		if invariants && op != "" {
			p.checkSlot(op, s)
		}
		off := int(s) * d
		switch ik.DType {
		case kernels.IndexFP8:
			copy(ik.FP8[off:off+d], rows[i*d:(i+1)*d])
			ik.Scales[s] = math.Float32frombits(binary.LittleEndian.Uint32(scales[i*4:]))
		case kernels.IndexBF16:
			getU16(ik.BF16[off:off+d], rows[i*d*2:])
		}
	}
	return nil
}

// checkSlots refuses a slot out of the pool's range.
func (p *Pool) checkSlots(slots []int32) error {
	for _, s := range slots {
		if s < 0 || int(s) >= p.cfg.Slots() {
			return fmt.Errorf("%w: slot %d of %d", ErrBadPage, s, p.cfg.Slots())
		}
	}
	return nil
}

// littleEndian: the machine stores a float32 as its little-endian bytes,
// so rows move by plain memory copies.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

func appendF32(b []byte, f []float32) []byte {
	if littleEndian && len(f) > 0 {
		return append(b, unsafe.Slice((*byte)(unsafe.Pointer(&f[0])), 4*len(f))...)
	}
	for _, x := range f {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func appendU16(b []byte, h []uint16) []byte {
	if littleEndian && len(h) > 0 {
		return append(b, unsafe.Slice((*byte)(unsafe.Pointer(&h[0])), 2*len(h))...)
	}
	for _, x := range h {
		b = binary.LittleEndian.AppendUint16(b, x)
	}
	return b
}

func getU16(dst []uint16, b []byte) {
	if littleEndian && len(dst) > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 2*len(dst)), b[:2*len(dst)])
		return
	}
	for i := range dst {
		dst[i] = binary.LittleEndian.Uint16(b[i*2:])
	}
}

func getF32(dst []float32, b []byte) {
	if littleEndian && len(dst) > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 4*len(dst)), b[:4*len(dst)])
		return
	}
	for i := range dst {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[i*4:]))
	}
}
