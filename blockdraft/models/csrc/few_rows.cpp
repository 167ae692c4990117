// y[M, N] = x[M, K] . W[N, K]^T for few rows M (a decode step's block or tree), fp32, AVX2 + FMA.
//
// W is packed once into panels of 16 output features, k-major: panel p holds W[16p .. 16p+15, :]
// as [K][16] (zero rows past N), so one panel is one sequential stream from memory. Each output
// y[m, n] is one accumulator over k = 0 .. K-1 in order (fma of x[m, k] broadcast with the panel's
// row k): the same operations whatever M is and wherever row m falls in a tile, so a row's result
// is bitwise the same at every row count (a block's rows equal one-token rows).
//
// Threads split the panels. Within a thread a panel is read from memory once and stays in L1/L2
// while every tile of rows multiplies it: at one row the kernel streams W at memory speed, at 16
// rows it is bound by the cores' FMA units instead of re-reading W per row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t NR = 16;  // output features per panel: two AVX2 vectors

// MR rows of x against NP consecutive panels (NV = 2 NP vectors of 8 outputs): MR * NV
// accumulators, each a named variable (an array of them made GCC store every one to the stack on
// every k), at most 12 of the 16 vector registers.
#define BD_ROW(i, DO) DO(i, 0) DO(i, 1) DO(i, 2) DO(i, 3) DO(i, 4) DO(i, 5) DO(i, 6) DO(i, 7)
#define BD_ROWS(DO) BD_ROW(0, DO) BD_ROW(1, DO) BD_ROW(2, DO) BD_ROW(3, DO) BD_ROW(4, DO) BD_ROW(5, DO)
#define BD_DECL(i, v) __m256 a##i##v = _mm256_setzero_ps();
#define BD_FMA(i, v) if constexpr (MR > i && NV > v) a##i##v = _mm256_fmadd_ps(xi, w##v, a##i##v);
#define BD_STORE(i, v) if constexpr (MR > i && NV > v) store(y + i * ldy, n0 + 8 * v, N, a##i##v);
#define BD_LOAD(v) const __m256 w##v = NV > v ? load8(panels + (v / 2) * stride + k * NR + 8 * (v % 2)) : zero;
// row i: its x[i, k] broadcast just before its FMAs (all six broadcast first would need 20 registers)
#define BD_STEP(i) if constexpr (MR > i) { const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k); BD_ROW(i, BD_FMA) }

// Eight weights as fp32: read as they are, or widened from bf16 (its 16 bits are fp32's upper half,
// so the widening is exact: a bf16 weight is computed with in fp32, at half the bytes to stream).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store(float* row, int64_t n, int64_t N, __m256 v) {
    if (n + 8 <= N) {
        _mm256_storeu_ps(row + n, v);
    } else if (n < N) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, v);
        for (int64_t j = 0; j < N - n; ++j) row[n + j] = tmp[j];
    }
}

template <int MR, int NP, bool PREFETCH, typename T>
inline void tile(const float* x, int64_t ldx, const T* panels, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N) {
    constexpr int NV = 2 * NP;
    static_assert(MR <= 6 && NV <= 8 && MR * NV <= 12, "accumulators must fit the registers");
    const __m256 zero = _mm256_setzero_ps();
    BD_ROWS(BD_DECL)
    const int64_t stride = K * NR;  // floats per panel
    for (int64_t k = 0; k < K; ++k) {
        // the next panels' row k (one cache line), read from memory while these rows compute
        if constexpr (PREFETCH && NP == 1)  // (at one to three rows it measured slower: memory-bound anyway)
            for (int p = NP; p < 2 * NP; ++p) _mm_prefetch(reinterpret_cast<const char*>(panels + p * stride + k * NR), _MM_HINT_T0);
        BD_LOAD(0) BD_LOAD(1) BD_LOAD(2) BD_LOAD(3) BD_LOAD(4) BD_LOAD(5) BD_LOAD(6) BD_LOAD(7)
        BD_STEP(0) BD_STEP(1) BD_STEP(2) BD_STEP(3) BD_STEP(4) BD_STEP(5)
    }
    BD_ROWS(BD_STORE)
}

template <int MR, int NP, typename T>
inline void rest(const float* x, int64_t K, const T* panels, float* y, int64_t N, int64_t n0, bool first) {
    if constexpr (MR * NP <= 6) {
        if (first) tile<MR, NP, true, T>(x, K, panels, K, y, N, n0, N);
        else tile<MR, NP, false, T>(x, K, panels, K, y, N, n0, N);
    }
}

// All rows of x against NP panels starting at panel p0, in tiles of 6 / NP rows.
template <int NP, typename T>
void rows_x_panels(const float* x, int64_t M, int64_t K, const T* packed, int64_t p0, float* y, int64_t N) {
    constexpr int MR = 6 / NP;
    const T* panels = packed + p0 * K * NR;
    const int64_t n0 = p0 * NR;
    int64_t m = 0;
    if (M >= MR) {  // the first tile prefetches the next panels; the rest read these from the cache
        tile<MR, NP, true, T>(x, K, panels, K, y, N, n0, N);
        m = MR;
    }
    for (; m + MR <= M; m += MR) tile<MR, NP, false, T>(x + m * K, K, panels, K, y + m * N, N, n0, N);
    switch (M - m) {
        case 5: rest<5, NP, T>(x + m * K, K, panels, y + m * N, N, n0, m == 0); break;
        case 4: rest<4, NP, T>(x + m * K, K, panels, y + m * N, N, n0, m == 0); break;
        case 3: rest<3, NP, T>(x + m * K, K, panels, y + m * N, N, n0, m == 0); break;
        case 2: rest<2, NP, T>(x + m * K, K, panels, y + m * N, N, n0, m == 0); break;
        case 1: rest<1, NP, T>(x + m * K, K, panels, y + m * N, N, n0, m == 0); break;
        default: break;
    }
}

}  // namespace

bool supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// W [N, K] -> [ceil(N / 16), K, 16], zero-padded, in W's dtype (fp32, or bf16 for `linear` to widen).
torch::Tensor pack(torch::Tensor w) {
    TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
                "pack: a 2-D float32 or bfloat16 weight");
    const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
    auto padded = torch::zeros({P * NR, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

template <typename T>
void run(const float* xp, int64_t M, int64_t K, const T* wp, int64_t P, float* yp, int64_t N) {
    // Panels per unit of work: at few rows, several panels at once keep enough independent
    // accumulator chains in flight (an FMA's latency is four of its issue slots).
    const int64_t np = M == 1 ? 4 : (M == 2 ? 3 : (M <= 3 ? 2 : 1));
    const int64_t units = (P + np - 1) / np;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
            int64_t p = u * np;
            const int64_t stop = std::min(P, p + np);
            if (stop - p == np) {
                if (np == 4) { rows_x_panels<4, T>(xp, M, K, wp, p, yp, N); continue; }
                if (np == 3) { rows_x_panels<3, T>(xp, M, K, wp, p, yp, N); continue; }
                if (np == 2) { rows_x_panels<2, T>(xp, M, K, wp, p, yp, N); continue; }
            }
            for (; p < stop; ++p) rows_x_panels<1, T>(xp, M, K, wp, p, yp, N);
        }
    });
}

// x [M, K] fp32 against packed panels (fp32 or bf16) -> y [M, N] fp32.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear: 2-D float32 rows");
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.size(1) == x.size(1) && packed.is_contiguous(),
                "linear: a weight packed for this input width");
    x = x.contiguous();
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "linear: N does not match the packed weight");
    auto y = torch::empty({M, N}, x.options());
    if (packed.scalar_type() == torch::kBFloat16)
        run(x.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), P,
            y.data_ptr<float>(), N);
    else
        run(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), P, y.data_ptr<float>(), N);
    return y;
}

// One row's RMSNorm: out = w * (r / sqrt(mean(r^2) + eps)). The sum of squares runs in one fixed
// order (eight lanes, then their sum), so a row's result never depends on the rows beside it.
inline void norm_row(const float* r, const float* w, int64_t H, float eps, float* out) {
    const int64_t H8 = H - H % 8;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t h = 0; h < H8; h += 8) {
        const __m256 v = _mm256_loadu_ps(r + h);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float ss = 0.f;
    for (int i = 0; i < 8; ++i) ss += lanes[i];
    for (int64_t h = H8; h < H; ++h) ss += r[h] * r[h];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    const __m256 s = _mm256_set1_ps(inv);
    for (int64_t h = 0; h < H8; h += 8)
        _mm256_storeu_ps(out + h, _mm256_mul_ps(_mm256_loadu_ps(w + h), _mm256_mul_ps(_mm256_loadu_ps(r + h), s)));
    for (int64_t h = H8; h < H; ++h) out[h] = w[h] * (r[h] * inv);
}

// RMSNorm of each row of x [M, H] (fp32), in one pass over the row where PyTorch's ops make about
// eight (and as many dispatches: tens of microseconds for a decode step's few rows).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && w.dim() == 1 &&
                x.size(-1) == w.size(0), "rms_norm: float32 rows and a float32 weight of their width");
    x = x.contiguous();
    w = w.contiguous();
    const int64_t H = x.size(-1), M = x.numel() / std::max<int64_t>(H, 1);
    auto y = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) norm_row(xp + m * H, wp, H, static_cast<float>(eps), yp + m * H);
    });
    return y;
}

// A drafter's per-head RMSNorm and rotary embedding in one pass: x [B, T, Hn, D] (a projection's
// output, contiguous) -> y [B, Hn, T, D] (the layout attention reads) with
// y = rope(w * x / sqrt(mean(x^2) + eps)), rope(v) = v * cos + rotate_half(v) * sin and
// rotate_half(v) = [-v[D/2:], v[:D/2]]; cos and sin [Bc, T, D] with Bc = 1 or B.
torch::Tensor norm_rope(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                w.numel() == x.size(3) && x.size(3) % 2 == 0, "norm_rope: float32 x [B, T, Hn, D], w [D]");
    TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(1) && cos.size(2) == x.size(3) &&
                (cos.size(0) == 1 || cos.size(0) == x.size(0)) && cos.scalar_type() == torch::kFloat32 &&
                sin.scalar_type() == torch::kFloat32, "norm_rope: cos/sin [1 or B, T, D] float32");
    x = x.contiguous();
    cos = cos.contiguous();
    sin = sin.contiguous();
    const int64_t B = x.size(0), T = x.size(1), Hn = x.size(2), D = x.size(3), half = D / 2;
    auto y = torch::empty({B, Hn, T, D}, x.options());
    const float* xp = x.data_ptr<float>();
    w = w.contiguous();
    const float* wp = w.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool per_row = cos.size(0) == B && B > 1;
    at::parallel_for(0, B * T * Hn, 256, [&](int64_t begin, int64_t end) {
        std::vector<float> n(D);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / (T * Hn), t = (i / Hn) % T, h = i % Hn;
            norm_row(xp + i * D, wp, D, static_cast<float>(eps), n.data());
            const int64_t c0 = ((per_row ? b : 0) * T + t) * D;
            float* o = yp + ((b * Hn + h) * T + t) * D;
            for (int64_t d = 0; d < half; ++d) o[d] = n[d] * cp[c0 + d] - n[d + half] * sp[c0 + d];
            for (int64_t d = half; d < D; ++d) o[d] = n[d] * cp[c0 + d] + n[d - half] * sp[c0 + d];
        }
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("norm_rope", &norm_rope);
    m.def("rms_norm", &rms_norm);
    m.def("supported", &supported);
    m.def("pack", &pack);
    m.def("linear", &linear);
}
