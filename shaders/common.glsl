// Shared header of every hmad compute shader. Each .comp starts with `#version 450` then includes this.
//
// Conventions (mirrored by hmad/backends/vulkan/pipelines.py):
// - workgroup size x is specialization constant 0 (BLOCK_SIZE), set per pipeline from Python;
// - bindings are storage buffers 0..N-1 in set 0, each bound as one (offset, range) of an arena: a shader
//   indexes from 0 and never sees arena offsets; tensors bigger than maxStorageBufferRange come in ranges;
// - the push-constant block of each op is mirrored field by field by one ctypes.Structure in pipelines.py
//   (std430 layout: 4-byte scalars only, in the same order).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0, local_size_y = 1, local_size_z = 1) in;
layout(constant_id = 0) const uint BLOCK_SIZE = 64;

#ifndef A_TYPE
#define A_TYPE float
#endif
#ifndef D_TYPE
#define D_TYPE float
#endif

// Flat index of this workgroup when a dispatch uses (x, y) groups to go past maxComputeWorkGroupCount[0].
uint group_index() {
    return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
}

// Invocations in the whole dispatch (the stride of grid-stride loops).
uint grid_size() {
    return gl_NumWorkGroups.x * gl_NumWorkGroups.y * BLOCK_SIZE;
}

uint global_index() {
    return group_index() * BLOCK_SIZE + gl_LocalInvocationID.x;
}

// gelu_tanh(g) * u (the GeGLU of Gemma's FFN): gelu_tanh(g) = g / (1 + exp(-2 a)), a = sqrt(2/pi) (g + 0.044715 g^3)
float gelu_mul(float g, float u) {
    const float a = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    return g / (1.0 + exp(-2.0 * a)) * u;
}

// 8 values k0..k7 (lo = k0..3, hi = k4..7) as float16 in the order the cooperative-matrix GEMM's tiles hold
// k: 0,2,1,3,4,6,5,7 (its decoded weights, and the float16 copy of x that row_scale.comp makes)
uvec4 pack8_tiles(vec4 lo, vec4 hi) {
    return uvec4(packHalf2x16(lo.xz), packHalf2x16(lo.yw), packHalf2x16(hi.xz), packHalf2x16(hi.yw));
}

// Defines T name(uint i): element i of buffer array x (of T: float or vec4), given as `splits` K-split partial
// sums n elements apart (the cooperative-matrix GEMM's scratch), added in split order as split_reduce.comp adds
// them, bit for bit: 0 + x_0 + x_1 + ...; one split is x[i] itself. Four splits' loads go out together.
#define SPLIT_SUM_READER(T, name, x, splits, n)                          \
    T name(uint i) {                                                     \
        if ((splits) == 1u) return x[i];                                 \
        T s = T(0.0);                                                    \
        uint sp = 0u;                                                    \
        for (; sp + 4u <= (splits); sp += 4u) {                          \
            const T a0 = x[sp * (n) + i], a1 = x[(sp + 1u) * (n) + i];   \
            const T a2 = x[(sp + 2u) * (n) + i], a3 = x[(sp + 3u) * (n) + i]; \
            s += a0;                                                     \
            s += a1;                                                     \
            s += a2;                                                     \
            s += a3;                                                     \
        }                                                                \
        for (; sp < (splits); ++sp) s += x[sp * (n) + i];                \
        return s;                                                        \
    }
