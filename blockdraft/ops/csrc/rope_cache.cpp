// A decode step's rotary embedding and cache append in one pass (llama_step.py): the few rows of a
// layer's Q, K and V projections in, the rotated queries out, the rotated keys and the values written
// into the layer's K/V buffer after its cached entries. transformers spends about sixteen small ops
// a layer on the same work (unsqueeze, two multiplies, rotate_half's slices, neg and cat, an add, for
// Q and for K, then the cache's own copy), each a dispatch that costs more than its arithmetic at a
// few rows.
//
// Bitwise what transformers computes: v * cos + rotate_half(v) * sin, each product rounded, then the
// sum (apply_rotary_pos_emb); rotate_half(v)[d] is -v[d + D/2] below D/2 and v[d - D/2] above, and
// a + (-b) * s rounds as a - b * s. The pragma keeps the compiler from fusing a product into the sum
// (an FMA rounds once, not twice, and would differ in the last bit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

// One head's rotation, each product rounded, then the sum. Never inlined: inlined into a caller
// compiled with the default contraction (at::parallel_for's instance), its products could be
// fused again.
__attribute__((noinline, optimize("fp-contract=off")))
void rope_head(const float* x, const float* c, const float* s, float* o, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] - x[d + half] * s[d];
    for (int64_t d = half; d < D; ++d) o[d] = x[d] * c[d] + x[d - half] * s[d];
}

}  // namespace

// q, k, v [B, T, H * D] (views of one fused projection's output are fine: only the last dimension
// must be contiguous), cos and sin [1 or B, T, D], kbuf and vbuf [B, Hk, capacity, D] contiguous.
// Writes rope(k) and v into kbuf and vbuf at slots n .. n + T - 1; returns rope(q) [B, Hq, T, D].
torch::Tensor rope_append(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t D, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor kbuf, torch::Tensor vbuf, int64_t n) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == torch::kFloat32 &&
                k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && q.stride(2) == 1 &&
                k.stride(2) == 1 && v.stride(2) == 1, "rope_append: float32 q, k, v [B, T, H * D], rows contiguous");
    const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2) / D, Hk = k.size(2) / D;
    TORCH_CHECK(D % 2 == 0 && q.size(2) == Hq * D && k.size(2) == Hk * D && v.sizes() == k.sizes() &&
                k.size(0) == B && k.size(1) == T, "rope_append: q, k, v of whole heads of size D");
    TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == T && cos.size(2) == D &&
                (cos.size(0) == 1 || cos.size(0) == B) && cos.scalar_type() == torch::kFloat32 &&
                sin.scalar_type() == torch::kFloat32, "rope_append: cos/sin [1 or B, T, D] float32");
    TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() && kbuf.size(0) == B && kbuf.size(1) == Hk &&
                kbuf.size(3) == D && n >= 0 && n + T <= kbuf.size(2) && kbuf.is_contiguous() && vbuf.is_contiguous() &&
                kbuf.scalar_type() == torch::kFloat32 && vbuf.scalar_type() == torch::kFloat32,
                "rope_append: buffers [B, Hk, capacity, D] float32 with room for T slots after n");
    cos = cos.contiguous();
    sin = sin.contiguous();
    auto out = torch::empty({B, Hq, T, D}, q.options());
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t cap = kbuf.size(2);
    const bool per_row = cos.size(0) == B && B > 1;
    float* op = out.data_ptr<float>();
    float* kb = kbuf.data_ptr<float>();
    float* vb = vbuf.data_ptr<float>();
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / T, t = i % T;
            const float* c = cp + ((per_row ? b : 0) * T + t) * D;
            const float* s = sp + ((per_row ? b : 0) * T + t) * D;
            const float* qr = qp + b * q.stride(0) + t * q.stride(1);
            const float* kr = kp + b * k.stride(0) + t * k.stride(1);
            const float* vr = vp + b * v.stride(0) + t * v.stride(1);
            for (int64_t h = 0; h < Hq; ++h) rope_head(qr + h * D, c, s, op + ((b * Hq + h) * T + t) * D, D);
            for (int64_t h = 0; h < Hk; ++h) {
                const int64_t slot = ((b * Hk + h) * cap + n + t) * D;
                rope_head(kr + h * D, c, s, kb + slot, D);
                for (int64_t d = 0; d < D; ++d) vb[slot + d] = vr[h * D + d];
            }
        }
    });
    return out;
}

#pragma GCC pop_options
