// y[M, N] = x[M, K] . W[N, K]^T for few rows M (a decode step's block or tree), fp32, AVX2 + FMA.
// W may be stored in bf16 or in int8 with a scale per output feature (a drafter's weights: fewer
// bytes to stream); both are widened to fp32 exactly and summed in fp32.
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

#include "units.h"
#include <cmath>
#include <type_traits>
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
#define BD_STORE(i, v) if constexpr (MR > i && NV > v) store(y + i * ldy, n0 + 8 * v, N, scaled(a##i##v, scale, n0 + 8 * v));
#define BD_SCALE(v) const typename R::Scale s##v = NV > v ? panels.scale(v / 2, k0, v % 2) : typename R::Scale{};
#define BD_LOAD(v) const __m256 w##v = NV > v ? panels(v / 2, k, v % 2, s##v) : zero;
// row i: its x[i, k] broadcast just before its FMAs (all six broadcast first would need 20 registers)
#define BD_STEP(i) if constexpr (MR > i) { const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k); BD_ROW(i, BD_FMA) }

// Eight weights as fp32: read as they are, or widened from bf16 (its 16 bits are fp32's upper half,
// so the widening is exact: a bf16 weight is computed with in fp32, at half the bytes to stream).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Eight int8 weights as fp32 (exact); their row's scale multiplies the sum once, at the store.
inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// An int8 weight's outputs times their rows' scales (float panels: none, the sums as they are).
inline __m256 scaled(__m256 v, const float* scale, int64_t n) {
    return scale == nullptr ? v : _mm256_mul_ps(v, _mm256_loadu_ps(scale + n));
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

// A weight's panels as the tiles read them: `r(p, k, h)` is eight fp32 weights, panel p (counted
// from the reader's first), input k, outputs 8h .. 8h+7; `r.line(p, k)` the memory behind them (to
// prefetch); `r.from(p)` the reader whose first panel is p.
// Weights come in spans of k that share their scales (`SPAN`, 0: the whole row): `r.scale(p, k0, h)`
// is what a span starting at k0 needs (read once per span, not once per k).
template <typename T>
struct Panels {  // fp32, bf16 or int8 panels [P][K][16], widened exactly by load8
    struct Scale {};
    static constexpr int64_t SPAN = 0;
    const T* data;
    int64_t stride;  // elements per panel: K * 16
    inline Scale scale(int, int64_t, int) const { return {}; }
    inline __m256 operator()(int p, int64_t k, int h, Scale) const { return load8(data + p * stride + k * NR + 8 * h); }
    inline const char* line(int p, int64_t k) const { return reinterpret_cast<const char*>(data + p * stride + k * NR); }
    inline Panels from(int64_t p) const { return {data + p * stride, stride}; }
};

// GGUF's blocks along k, kept as the file stores them and dequantized here in registers, exactly
// as the `gguf` package dequantizes them (so a layer computes with the very fp32 weights a
// dequantized copy holds). A span of k (a block, or a K-quant's sub-block) shares a scale d and an
// offset m per output: Q4_0 d * (q - 8), Q4_1 (d * q) + m, Q8_0 d * q with d and m fp16, widened
// exactly; the K-quants with d and m fp32, as `gguf` computes them from the super-block's fp16
// scales and 6- or 8-bit sub-scales (exact products): Q4_K (d * q) - dmin_m (span 32, m = -dmin_m),
// Q6_K d * (q - 32) (span 16, the codes stored as q - 32 in int8). Each product of such a scale by
// a 4-bit code, or of an fp16 by an 8-bit one, is exact in fp32, so the one rounding of the
// 4-bit kinds is the same fused or not: they dequantize by one fma(q, d, m) (Q4_0's m = -8 d).
// Codes [P][K][8] bytes (4-bit: output j's code in the low nibble of byte j, output j + 8's in the
// high one) or [P][K][16] int8; d, m [P][K / SPAN][16].
enum BlockKind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q6_K = 4 };

template <int KIND>
struct Blocks {
    struct Scale { __m256 d, m; };
    static constexpr bool EIGHT_BIT = KIND == Q8_0 || KIND == Q6_K;  // int8 codes, no offset
    static constexpr bool FP32_SCALES = KIND == Q4_K || KIND == Q6_K;
    static constexpr bool OFFSET = KIND == Q4_1 || KIND == Q4_K;  // m stored (Q4_0's is derived from d)
    static constexpr int64_t SPAN = KIND == Q6_K ? 16 : 32;
    static constexpr int64_t CODE_BYTES = EIGHT_BIT ? NR : NR / 2;  // per panel and k
    const uint8_t* codes;
    const void* d;
    const void* m;  // Q4_1 and Q4_K only
    int64_t code_stride, scale_stride;  // bytes / scales per panel: K * CODE_BYTES, K / SPAN * 16
    inline __m256 load_scale(const void* base, int64_t s) const {
        if constexpr (FP32_SCALES)
            return _mm256_loadu_ps(static_cast<const float*>(base) + s);
        else
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + s)));
    }
    inline Scale scale(int p, int64_t k0, int h) const {
        const int64_t s = p * scale_stride + (k0 / SPAN) * NR + 8 * h;
        const __m256 d8 = load_scale(d, s);
        if constexpr (OFFSET) return {d8, load_scale(m, s)};
        if constexpr (KIND == Q4_0) return {d8, _mm256_mul_ps(d8, _mm256_set1_ps(-8.f))};  // exact
        return {d8, _mm256_setzero_ps()};
    }
    inline __m256 operator()(int p, int64_t k, int h, const Scale& s) const {
        const uint8_t* c = codes + p * code_stride + k * CODE_BYTES;
        if constexpr (EIGHT_BIT) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * h)));
            return _mm256_mul_ps(s.d, _mm256_cvtepi32_ps(q));
        } else {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
            q = h ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0x0F));
            return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s.d, s.m);  // d * q exact: one rounding either way
        }
    }
    inline const char* line(int p, int64_t k) const {
        return reinterpret_cast<const char*>(codes + p * code_stride + k * CODE_BYTES);
    }
    inline Blocks from(int64_t p) const {
        const int64_t bytes = (FP32_SCALES ? 4 : 2) * p * scale_stride;
        auto at = [bytes](const void* base) { return base == nullptr ? nullptr : static_cast<const char*>(base) + bytes; };
        return {codes + p * code_stride, at(d), at(m), code_stride, scale_stride};
    }
};

template <int MR, int NP, bool PREFETCH, typename R>
inline void tile(const float* x, int64_t ldx, const R& panels, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N, const float* scale) {
    constexpr int NV = 2 * NP;
    static_assert(MR <= 6 && NV <= 8 && MR * NV <= 12, "accumulators must fit the registers");
    const __m256 zero = _mm256_setzero_ps();
    BD_ROWS(BD_DECL)
    const int64_t span = R::SPAN ? R::SPAN : K;
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        BD_SCALE(0) BD_SCALE(1) BD_SCALE(2) BD_SCALE(3) BD_SCALE(4) BD_SCALE(5) BD_SCALE(6) BD_SCALE(7)
        for (int64_t k = k0; k < k0 + span; ++k) {
            // the next panels' row k (one cache line), read from memory while these rows compute
            if constexpr (PREFETCH && NP == 1)  // (at one to three rows it measured slower: memory-bound anyway)
                for (int p = NP; p < 2 * NP; ++p) _mm_prefetch(panels.line(p, k), _MM_HINT_T0);
            BD_LOAD(0) BD_LOAD(1) BD_LOAD(2) BD_LOAD(3) BD_LOAD(4) BD_LOAD(5) BD_LOAD(6) BD_LOAD(7)
            BD_STEP(0) BD_STEP(1) BD_STEP(2) BD_STEP(3) BD_STEP(4) BD_STEP(5)
        }
    }
    BD_ROWS(BD_STORE)
}

template <int MR, int NP, typename R>
inline void rest(const float* x, int64_t K, const R& panels, float* y, int64_t N, int64_t n0, bool first,
                 const float* scale) {
    if constexpr (MR * NP <= 6) {
        if (first) tile<MR, NP, true, R>(x, K, panels, K, y, N, n0, N, scale);
        else tile<MR, NP, false, R>(x, K, panels, K, y, N, n0, N, scale);
    }
}

// All rows of x against NP panels starting at panel p0, in tiles of 6 / NP rows.
template <int NP, typename R>
void rows_x_panels(const float* x, int64_t M, int64_t K, const R& packed, int64_t p0, float* y, int64_t N,
                   const float* scale) {
    constexpr int MR = 6 / NP;
    const R panels = packed.from(p0);
    const int64_t n0 = p0 * NR;
    int64_t m = 0;
    if (M >= MR) {  // the first tile prefetches the next panels; the rest read these from the cache
        tile<MR, NP, true, R>(x, K, panels, K, y, N, n0, N, scale);
        m = MR;
    }
    for (; m + MR <= M; m += MR) tile<MR, NP, false, R>(x + m * K, K, panels, K, y + m * N, N, n0, N, scale);
    switch (M - m) {
        case 5: rest<5, NP, R>(x + m * K, K, panels, y + m * N, N, n0, m == 0, scale); break;
        case 4: rest<4, NP, R>(x + m * K, K, panels, y + m * N, N, n0, m == 0, scale); break;
        case 3: rest<3, NP, R>(x + m * K, K, panels, y + m * N, N, n0, m == 0, scale); break;
        case 2: rest<2, NP, R>(x + m * K, K, panels, y + m * N, N, n0, m == 0, scale); break;
        case 1: rest<1, NP, R>(x + m * K, K, panels, y + m * N, N, n0, m == 0, scale); break;
        default: break;
    }
}

}  // namespace

bool supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// W [N, K] -> [ceil(N / 16), K, 16], zero-padded, in W's dtype (fp32, or bf16 or int8 for `linear`
// to widen).
torch::Tensor pack(torch::Tensor w) {
    TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16 ||
                                 w.scalar_type() == torch::kChar),
                "pack: a 2-D float32, bfloat16 or int8 weight");
    const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
    auto padded = torch::zeros({P * NR, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

template <typename R>
void run(const float* xp, int64_t M, int64_t K, const R& wp, int64_t P, float* yp, int64_t N,
         const float* scale = nullptr) {
    // Panels per unit of work: at few rows, several panels at once keep enough independent
    // accumulator chains in flight (an FMA's latency is four of its issue slots).
    const int64_t np = M == 1 ? 4 : (M == 2 ? 3 : (M <= 3 ? 2 : 1));
    over_units(P, np, [&](int64_t p) {
        if (np == 4) rows_x_panels<4, R>(xp, M, K, wp, p, yp, N, scale);
        else if (np == 3) rows_x_panels<3, R>(xp, M, K, wp, p, yp, N, scale);
        else if (np == 2) rows_x_panels<2, R>(xp, M, K, wp, p, yp, N, scale);
        else rows_x_panels<1, R>(xp, M, K, wp, p, yp, N, scale);
    }, [&](int64_t p) { rows_x_panels<1, R>(xp, M, K, wp, p, yp, N, scale); });
}

// blocks512.cpp: the same kernels with AVX-512 (bitwise the same outputs), where the CPU has it
bool avx512_usable();
void panel_run512(int dtype, const float* x, int64_t M, int64_t K, const void* data, int64_t P, float* y, int64_t N,
                  const float* scale);
void block_run512(int kind, const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* d,
                  const void* m, int64_t code_stride, int64_t scale_stride, int64_t P, float* y, int64_t N);
void block_dequantize512(int kind, int64_t K, const uint8_t* codes, const void* d, const void* m,
                         int64_t code_stride, int64_t scale_stride, int64_t P, float* out, int64_t N);
bool g_avx512 = avx512_usable();

// Whether `block_linear` runs the AVX-512 kernel (on = where the CPU has it); returns the setting.
bool set_avx512(bool on) {
    g_avx512 = on && avx512_usable();
    return g_avx512;
}

// x [M, K] fp32 against packed panels (fp32, bf16, or int8 with a scale per output row in `scales`,
// [P * 16] fp32; an empty tensor otherwise) -> y [M, N] fp32.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor scales) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear: 2-D float32 rows");
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.size(1) == x.size(1) && packed.is_contiguous(),
                "linear: a weight packed for this input width");
    x = x.contiguous();
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "linear: N does not match the packed weight");
    TORCH_CHECK(packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16 ||
                packed.scalar_type() == torch::kChar, "linear: float32, bfloat16 or int8 panels");
    auto y = torch::empty({M, N}, x.options());
    if (packed.scalar_type() == torch::kChar)
        TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == P * NR,
                    "linear: int8 panels need their rows' scales [P * 16] float32");
    if (g_avx512) {
        const int dtype = packed.scalar_type() == torch::kFloat32 ? 0 : (packed.scalar_type() == torch::kBFloat16 ? 1 : 2);
        panel_run512(dtype, x.data_ptr<float>(), M, K, packed.data_ptr(), P, y.data_ptr<float>(), N,
                     dtype == 2 ? scales.data_ptr<float>() : nullptr);
        return y;
    }
    if (packed.scalar_type() == torch::kChar) {
        run(x.data_ptr<float>(), M, K, Panels<int8_t>{packed.data_ptr<int8_t>(), K * NR}, P, y.data_ptr<float>(), N,
            scales.data_ptr<float>());
    } else if (packed.scalar_type() == torch::kBFloat16)
        run(x.data_ptr<float>(), M, K,
            Panels<uint16_t>{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K * NR}, P,
            y.data_ptr<float>(), N);
    else
        run(x.data_ptr<float>(), M, K, Panels<float>{packed.data_ptr<float>(), K * NR}, P, y.data_ptr<float>(), N);
    return y;
}

// x [M, K] fp32 against a GGUF weight's blocks in panels (`Blocks`): codes [P, K, 8] uint8 (4-bit
// kinds) or [P, K, 16] int8 (Q8_0, Q6_K), d and m [P, K / SPAN, 16], fp16 (Q4_0, Q4_1, Q8_0) or fp32
// (the K-quants), m only for Q4_1 and Q4_K (else empty) -> y [M, N] fp32, each output summed as
// `linear` sums it: bitwise what `linear` gives on the dequantized weight.
template <int KIND>
Blocks<KIND> checked_blocks(int64_t K, const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m,
                            int64_t N) {
    using B = Blocks<KIND>;
    const int64_t P = codes.size(0);
    TORCH_CHECK(codes.dim() == 3 && codes.size(1) == K && codes.size(2) == B::CODE_BYTES && codes.is_contiguous() &&
                codes.element_size() == 1 && K % 32 == 0, "block_linear: codes packed for this input width");
    TORCH_CHECK(d.scalar_type() == (B::FP32_SCALES ? torch::kFloat32 : torch::kHalf) && d.is_contiguous() &&
                d.numel() == P * (K / B::SPAN) * NR, "block_linear: d [P, K / span, 16] of the kind's scale type");
    TORCH_CHECK(!B::OFFSET || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.sizes() == d.sizes()),
                "block_linear: Q4_1 and Q4_K need m shaped as d");
    TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "block_linear: N does not match the packed weight");
    return {reinterpret_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr(), B::OFFSET ? m.data_ptr() : nullptr,
            K * B::CODE_BYTES, K / B::SPAN * NR};
}

template <int KIND>
void block_run(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m,
               torch::Tensor& y) {
    const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = y.size(1);
    const Blocks<KIND> blocks = checked_blocks<KIND>(K, codes, d, m, N);
    if (g_avx512)
        block_run512(KIND, x.data_ptr<float>(), M, K, blocks.codes, blocks.d, blocks.m, blocks.code_stride,
                     blocks.scale_stride, P, y.data_ptr<float>(), N);
    else
        run(x.data_ptr<float>(), M, K, blocks, P, y.data_ptr<float>(), N);
}

// f(std::integral_constant<int, kind>) for each of the block kinds; `what` names the caller in the error.
template <typename F>
void by_kind(int64_t kind, const char* what, F&& f) {
    switch (kind) {
        case Q4_0: f(std::integral_constant<int, Q4_0>{}); break;
        case Q4_1: f(std::integral_constant<int, Q4_1>{}); break;
        case Q8_0: f(std::integral_constant<int, Q8_0>{}); break;
        case Q4_K: f(std::integral_constant<int, Q4_K>{}); break;
        case Q6_K: f(std::integral_constant<int, Q6_K>{}); break;
        default: TORCH_CHECK(false, what, ": kind is Q4_0, Q4_1, Q8_0, Q4_K or Q6_K");
    }
}

torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t N,
                           int64_t kind) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "block_linear: 2-D float32 rows");
    x = x.contiguous();
    auto y = torch::empty({x.size(0), N}, x.options());
    by_kind(kind, "block_linear", [&](auto k) { block_run<decltype(k)::value>(x, codes, d, m, y); });
    return y;
}

// The fp32 weight [N, K] a weight's blocks (as `block_linear` takes them) stand for, bitwise
// `gguf`'s dequantization: with AVX-512 only (`dequantize_usable`; elsewhere the caller uses torch).
template <int KIND>
void dequantize_kind(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m, torch::Tensor& out) {
    const int64_t K = out.size(1), N = out.size(0);
    const Blocks<KIND> b = checked_blocks<KIND>(K, codes, d, m, N);
    block_dequantize512(KIND, K, b.codes, b.d, b.m, b.code_stride, b.scale_stride, codes.size(0), out.data_ptr<float>(), N);
}

torch::Tensor block_dequantize(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t N, int64_t kind) {
    TORCH_CHECK(g_avx512, "block_dequantize: needs AVX-512 (dequantize_usable)");
    TORCH_CHECK(codes.dim() == 3, "block_dequantize: codes [P, K, bytes]");
    auto out = torch::empty({N, codes.size(1)}, d.options().dtype(torch::kFloat32));
    by_kind(kind, "block_dequantize", [&](auto k) { dequantize_kind<decltype(k)::value>(codes, d, m, out); });
    return out;
}

bool dequantize_usable() { return g_avx512; }

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

// exp of eight floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n), within 2 ulp of expf for x in [-87, 88]; below that 0 (softmax scores minus their
// maximum are <= 0). The same operations for every lane: a row's softmax never depends on where
// its scores fall in a vector or on the rows beside it.
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762f)), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The sum of eight lanes in one fixed order.
inline float hsum8(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// The scaled dot products of query row q with four keys (rows keys[0..3] of kb, `stride` apart):
// per key, one product vector accumulated over D in order, then its eight lanes summed.
inline void scores4(const float* q, const float* kb, int64_t stride, const int64_t* keys, int64_t V, float scale,
                    float* out) {
    const float* k0 = kb + keys[0] * stride;
    const float* k1 = kb + keys[1] * stride;
    const float* k2 = kb + keys[2] * stride;
    const float* k3 = kb + keys[3] * stride;
    __m256 q0 = _mm256_loadu_ps(q);
    __m256 a0 = _mm256_mul_ps(q0, _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(q0, _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(q0, _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(q0, _mm256_loadu_ps(k3));
    for (int64_t c = 1; c < V; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k1 + 8 * c), a1);
        a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k2 + 8 * c), a2);
        a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k3 + 8 * c), a3);
    }
    out[0] = hsum8(a0) * scale;
    out[1] = hsum8(a1) * scale;
    out[2] = hsum8(a2) * scale;
    out[3] = hsum8(a3) * scale;
}

// o = inv * sum_r p[r] v[keys[r]] over the row's n visible keys in order; VC vectors of 8 (0: V, at run time).
template <int VC>
inline void weighted_sum(const float* p, const int64_t* keys, int64_t n, const float* vb, int64_t vstride, float inv,
                         float* o, int64_t V = VC) {
    constexpr int R = VC > 0 ? VC : 64;
    __m256 acc[R];
    const int64_t nv = VC > 0 ? VC : V;
    for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t r = 0; r < n; ++r) {
        const float* vr = vb + keys[r] * vstride;
        const __m256 w = _mm256_set1_ps(p[r]);
        for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], iv));
}

// Attention of a decode step's few query rows: q [B, Hq, T, D], k and v [B, Hkv, S, D] (views of a
// cache's buffer: any strides over B, heads and S, unit stride over D), each K/V head shared by
// Hq / Hkv query heads; `mask` [B, 1 or Hq, T, S] bool (True = may attend), or an empty tensor
// when every row sees every key. Returns [B, T, Hq, D] (what transformers' attention functions
// return). A row's visible keys are gathered in key order, then scored, softmaxed and summed in
// that order: its output depends on its query and the keys it sees, not on the rows beside it nor
// on masked keys between them (a tree's row equals the same token decoded alone after its path).
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == torch::kFloat32 &&
                k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
                "attention: float32 q [B, Hq, T, D], k and v [B, Hkv, S, D]");
    const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
    const int64_t Hkv = k.size(1), S = k.size(2);
    TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
                v.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0 && D <= 512,
                "attention: shapes do not match (D a multiple of 8, Hq a multiple of Hkv)");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v contiguous in D");
    const bool masked = mask.numel() > 0;
    if (masked)
        TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == torch::kBool && mask.size(0) == B &&
                    (mask.size(1) == 1 || mask.size(1) == Hq) && mask.size(2) == T && mask.size(3) == S,
                    "attention: a bool mask [B, 1 or Hq, T, S]");
    q = q.contiguous();
    auto out = torch::empty({B, T, Hq, D}, q.options());
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
    float* op = out.data_ptr<float>();
    const int64_t group = Hq / Hkv, V = D / 8;
    const auto ks = k.strides(), vs = v.strides();
    const auto ms = masked ? mask.strides() : k.strides();  // (unused unmasked)
    const bool mask_heads = masked && mask.size(1) == Hq;
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, B * Hq * T, 4, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> keys(S);
        std::vector<float> p(S + 8);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / (Hq * T), h = (i / T) % Hq, t = i % T, g = h / group;
            const float* qr = qp + ((b * Hq + h) * T + t) * D;
            const float* kb = kp + b * ks[0] + g * ks[1];
            const float* vb = vp + b * vs[0] + g * vs[1];
            int64_t n = 0;
            if (masked) {
                const bool* mr = mp + b * ms[0] + (mask_heads ? h * ms[1] : 0) + t * ms[2];
                for (int64_t j = 0; j < S; ++j) if (mr[j * ms[3]]) keys[n++] = j;
            } else {
                for (int64_t j = 0; j < S; ++j) keys[n++] = j;
            }
            float* o = op + ((b * T + t) * Hq + h) * D;
            if (n == 0) {  // nothing visible: zeros (SDPA would give NaN)
                for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
                continue;
            }
            // scores, four keys at a time (independent chains in flight); each key's own
            // operations are the same wherever it falls in a group of four
            int64_t j0 = 0;
            for (; j0 + 4 <= n; j0 += 4)
                scores4(qr, kb, ks[2], keys.data() + j0, V, sc, p.data() + j0);
            for (; j0 < n; ++j0) {
                const int64_t same[4] = {keys[j0], keys[j0], keys[j0], keys[j0]};
                float out4[4];
                scores4(qr, kb, ks[2], same, V, sc, out4);
                p[j0] = out4[0];
            }
            float m = -INFINITY;
            for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sum = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + j), mv));
                _mm256_storeu_ps(p.data() + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            if (j < n) {  // the tail, padded with -inf (exp 0)
                alignas(32) float tail[8];
                for (int64_t c = 0; c < 8; ++c) tail[c] = j + c < n ? p[j + c] : -INFINITY;
                const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv));
                _mm256_storeu_ps(p.data() + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            const float inv = 1.f / hsum8(sum);
            switch (V) {  // the row's accumulators in registers where D is a common head size
                case 4: weighted_sum<4>(p.data(), keys.data(), n, vb, vs[2], inv, o); break;
                case 8: weighted_sum<8>(p.data(), keys.data(), n, vb, vs[2], inv, o); break;
                case 16: weighted_sum<16>(p.data(), keys.data(), n, vb, vs[2], inv, o); break;
                default: weighted_sum<0>(p.data(), keys.data(), n, vb, vs[2], inv, o, V);
            }
        }
    });
    return out;
}

// rope_cache.cpp (compiled without fused multiply-adds)
torch::Tensor rope_append(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t D, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor kbuf, torch::Tensor vbuf, int64_t n);

// q8.cpp (the opt-in int8-activation mode)
bool q8_usable();
torch::Tensor pack_vnni(torch::Tensor codes, int64_t kind);
torch::Tensor block_linear_q8(torch::Tensor x, torch::Tensor vnni, torch::Tensor d, torch::Tensor m, int64_t N,
                              int64_t kind);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("attention", &attention);
    m.def("rope_append", &rope_append);
    m.def("set_avx512", &set_avx512);
    m.def("q8_usable", &q8_usable);
    m.def("pack_vnni", &pack_vnni);
    m.def("block_linear_q8", &block_linear_q8);
    m.def("norm_rope", &norm_rope);
    m.def("rms_norm", &rms_norm);
    m.def("supported", &supported);
    m.def("pack", &pack);
    m.def("linear", &linear);
    m.def("block_linear", &block_linear);
    m.def("block_dequantize", &block_dequantize);
    m.def("dequantize_usable", &dequantize_usable);
}
