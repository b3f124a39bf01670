package cpu

// kernelSetsUnderTest names the kernel sets this machine can run: the
// default one, the AVX2 set alone where the default adds AVX-512 kernels,
// and the portable one.
func kernelSetsUnderTest() []string {
	sets := []string{asmKernelsName()}
	if sets[0] == "avx2+avx512" {
		sets = append(sets, "avx2")
	}
	return append(sets, "portable")
}

// asmKernelsName is the name of the set New picks.
func asmKernelsName() string {
	b := newBackend(1, false)
	defer b.Close()
	return b.Kernels()
}

// testBackend is a backend on the named kernel set (see kernelSetsUnderTest).
func testBackend(threads int, set string) *Backend {
	b := newBackend(threads, set == "portable")
	if set == "avx2" {
		k := *b.k
		k.name, k.q8Pairs, k.dot6x8 = "avx2", nil, nil
		b.k = &k
	}
	return b
}
