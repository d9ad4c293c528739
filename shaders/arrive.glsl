// The last workgroup of a piece of work goes on to the step that needs all of it, in the same dispatch (one
// dispatch and one pipeline barrier fewer than a second kernel): every workgroup that contributes writes its
// part, then arrives at the piece's counter; the one that arrives last (it sees total - 1) reads what the
// others wrote and sets the counter back to 0 for the next dispatch that uses it. The buffers written before
// arriving and read after must be declared `coherent` (past the per-SM caches), and the counters start at 0
// (the host zeroes them when it allocates them, and at the start of every recorded step).
// Cost: the arrival (a device-scope memory barrier, an atomic round trip) and a coherent load each wait on
// L2, and on NVIDIA coherent loads do not overlap: a tail reads what the others wrote once, as vec4s spread
// over the workgroup. Measured (docs/tuning.md): worth it only for a tail that
// runs in many workgroups at once (matvec_qout.glsl); a serial tail in one workgroup (the residual step after
// an output projection, the attention's reduce) cost more than the dispatch and barrier it saved. (The Vulkan
// memory model's availability/visibility barriers, which would allow cached loads, miscompile on Mesa 22.3's
// lavapipe.)
// Include after declaring `coherent buffer ... { uint cnt[]; }`.

shared uint arrive_ticket;

// Whether this workgroup is the last of `total` to arrive at counter `slot`; uniform per workgroup, and every
// invocation must call it (it holds barriers).
bool last_to_arrive(uint slot, uint total) {
    memoryBarrierBuffer();  // this invocation's writes before the arrival
    barrier();
    if (gl_LocalInvocationID.x == 0u) arrive_ticket = atomicAdd(cnt[slot], 1u);
    barrier();
    const bool last = arrive_ticket == total - 1u;
    if (last) {
        memoryBarrierBuffer();  // the others' writes, before ours reads them
        if (gl_LocalInvocationID.x == 0u) cnt[slot] = 0u;
    }
    return last;
}
