// The GGUF block kernel of few_rows.cpp (`block_linear`) with AVX-512: a panel's 16 outputs are
// one 512-bit vector where AVX2 needs two, so a block of codes is widened and dequantized by half
// the instructions and each row's multiply-add covers 16 outputs at once. At one row the AVX2
// kernel is bound by its dequantizing instructions, not by memory; at a verify's 16 rows, by its
// multiply-adds.
//
// Bitwise the AVX2 kernel: the same weights (each dequantized by the same operations: 4-bit kinds
// fma(q, d, m), 8-bit ones d * q), and each output one accumulator over k in order,
// acc = fma(x[m, k], w[k, n], acc) from zero, whatever the row count or the tile a row falls in.
// Compiled for AVX-512 in this file alone; `block_run512` runs only where the CPU has it
// (`avx512_usable`), else the caller runs the AVX2 kernel.
#pragma GCC target("avx512f,avx512bw,avx512vl,f16c,fma")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t NR = 16;  // outputs per panel: one 512-bit vector
enum BlockKind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q6_K = 4 };  // as few_rows.cpp numbers them

// A weight's blocks as few_rows.cpp's `Blocks` lays them out: codes [P][K][8] bytes (4-bit: output
// j's code in the low nibble of byte j, output j + 8's in the high one) or [P][K][16] int8, and
// d, m [P][K / SPAN][16] (fp16, or fp32 for the K-quants).
template <int KIND>
struct Blocks16 {
    struct Scale { __m512 d, m; };
    static constexpr bool EIGHT_BIT = KIND == Q8_0 || KIND == Q6_K;
    static constexpr bool FP32_SCALES = KIND == Q4_K || KIND == Q6_K;
    static constexpr bool OFFSET = KIND == Q4_1 || KIND == Q4_K;
    static constexpr int64_t SPAN = KIND == Q6_K ? 16 : 32;
    static constexpr int64_t CODE_BYTES = EIGHT_BIT ? NR : NR / 2;
    const uint8_t* codes;
    const char* d;
    const char* m;
    int64_t code_stride, scale_stride;
    inline __m512 load_scale(const char* base, int64_t s) const {
        if constexpr (FP32_SCALES)
            return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + s);
        else
            return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(base) + s)));
    }
    inline Scale scale(int p, int64_t k0) const {
        const int64_t s = p * scale_stride + (k0 / SPAN) * NR;
        const __m512 d16 = load_scale(d, s);
        if constexpr (OFFSET) return {d16, load_scale(m, s)};
        if constexpr (KIND == Q4_0) return {d16, _mm512_mul_ps(d16, _mm512_set1_ps(-8.f))};  // exact
        return {d16, _mm512_setzero_ps()};
    }
    inline __m512 operator()(int p, int64_t k, const Scale& s) const {
        const uint8_t* c = codes + p * code_stride + k * CODE_BYTES;
        if constexpr (EIGHT_BIT) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
            return _mm512_mul_ps(s.d, _mm512_cvtepi32_ps(q));
        } else {
            const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
            const __m128i low = _mm_set1_epi8(0x0F);
            // bytes 0..7: outputs 0..7 (low nibbles), bytes 8..15: outputs 8..15 (high nibbles)
            const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both)), s.d, s.m);
        }
    }
    inline const char* line(int p, int64_t k) const {
        return reinterpret_cast<const char*>(codes + p * code_stride + k * CODE_BYTES);
    }
    inline const char* scale_line(const char* base, int p, int64_t k0) const {
        return base + (FP32_SCALES ? 4 : 2) * (p * scale_stride + (k0 / SPAN) * NR);
    }
    inline Blocks16 from(int64_t p) const {
        const int64_t bytes = (FP32_SCALES ? 4 : 2) * p * scale_stride;
        return {codes + p * code_stride, d + bytes, m == nullptr ? nullptr : m + bytes, code_stride, scale_stride};
    }
};

inline void store16(float* row, int64_t n, int64_t N, __m512 v) {
    if (n + NR <= N) _mm512_storeu_ps(row + n, v);
    else if (n < N) _mm512_mask_storeu_ps(row + n, static_cast<__mmask16>((1u << (N - n)) - 1), v);
}

// MR rows of x against NP panels: MR * NP accumulators, each a named variable (an array of them
// can be kept on the stack), at most 16 of the 32 vector registers.
#define B5_ROW(i, DO) DO(i, 0) DO(i, 1) DO(i, 2) DO(i, 3)
#define B5_ROWS(DO) B5_ROW(0, DO) B5_ROW(1, DO) B5_ROW(2, DO) B5_ROW(3, DO) B5_ROW(4, DO) B5_ROW(5, DO) \
    B5_ROW(6, DO) B5_ROW(7, DO)
#define B5_DECL(i, p) __m512 a##i##p = _mm512_setzero_ps();
#define B5_FMA(i, p) if constexpr (MR > i && NP > p) a##i##p = _mm512_fmadd_ps(xi, w##p, a##i##p);
#define B5_STORE(i, p) if constexpr (MR > i && NP > p) store16(y + i * ldy, n0 + NR * p, N, a##i##p);
#define B5_SCALE(p) const typename R::Scale s##p = NP > p ? panels.scale(p, k0) : typename R::Scale{};
#define B5_LOAD(p) const __m512 w##p = NP > p ? panels(p, k, s##p) : _mm512_setzero_ps();
// the next unit's panels (the same thread's next), a cache line of their codes and scales at a time
#define B5_FETCH(p) if constexpr (NP > p) _mm_prefetch(panels.line(NP + p, k), _MM_HINT_T0);
#define B5_FETCH_SCALES(p) if constexpr (NP > p) { _mm_prefetch(panels.scale_line(panels.d, NP + p, k0), _MM_HINT_T0); \
    if constexpr (R::OFFSET) _mm_prefetch(panels.scale_line(panels.m, NP + p, k0), _MM_HINT_T0); }
#define B5_STEP(i) if constexpr (MR > i) { const __m512 xi = _mm512_set1_ps(x[i * ldx + k]); B5_ROW(i, B5_FMA) }

template <int MR, int NP, typename R, bool PREFETCH = false>
inline void tile(const float* x, int64_t ldx, const R& panels, int64_t K, float* y, int64_t ldy, int64_t n0,
                 int64_t N) {
    static_assert(MR <= 8 && NP <= 4 && MR * NP <= 16, "accumulators must fit the registers");
    B5_ROWS(B5_DECL)
    for (int64_t k0 = 0; k0 < K; k0 += R::SPAN) {
        B5_SCALE(0) B5_SCALE(1) B5_SCALE(2) B5_SCALE(3)
        if constexpr (PREFETCH) if ((k0 / R::SPAN) % (64 / (NR * (R::FP32_SCALES ? 4 : 2))) == 0) {
            B5_FETCH_SCALES(0) B5_FETCH_SCALES(1) B5_FETCH_SCALES(2) B5_FETCH_SCALES(3)
        }
        for (int64_t k = k0; k < k0 + R::SPAN; ++k) {
            if constexpr (PREFETCH) if (k % (64 / R::CODE_BYTES) == 0) { B5_FETCH(0) B5_FETCH(1) B5_FETCH(2) B5_FETCH(3) }
            B5_LOAD(0) B5_LOAD(1) B5_LOAD(2) B5_LOAD(3)
            B5_STEP(0) B5_STEP(1) B5_STEP(2) B5_STEP(3) B5_STEP(4) B5_STEP(5) B5_STEP(6) B5_STEP(7)
        }
    }
    B5_ROWS(B5_STORE)
}

// All M rows of x against NP panels from p0: tiles of 16 / NP rows (at most 8), then the rest.
template <int NP, typename R>
void rows_x_panels(const float* x, int64_t M, int64_t K, const R& packed, int64_t p0, float* y, int64_t N) {
    constexpr int MR = 16 / NP > 8 ? 8 : 16 / NP;
    const R panels = packed.from(p0);
    const int64_t n0 = p0 * NR;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile<MR, NP, R>(x + m * K, K, panels, K, y + m * N, N, n0, N);
    const float* xr = x + m * K;
    float* yr = y + m * N;
    switch (M - m) {
        case 7: if constexpr (7 * NP <= 16) tile<7, NP, R>(xr, K, panels, K, yr, N, n0, N); break;
        case 6: if constexpr (6 * NP <= 16) tile<6, NP, R>(xr, K, panels, K, yr, N, n0, N); break;
        case 5: if constexpr (5 * NP <= 16) tile<5, NP, R>(xr, K, panels, K, yr, N, n0, N); break;
        case 4: if constexpr (4 * NP <= 16) tile<4, NP, R>(xr, K, panels, K, yr, N, n0, N); break;
        case 3: if constexpr (3 * NP <= 16) tile<3, NP, R>(xr, K, panels, K, yr, N, n0, N); break;
        case 2: tile<2, NP, R, NP == 4>(xr, K, panels, K, yr, N, n0, N); break;
        case 1: tile<1, NP, R, NP == 4>(xr, K, panels, K, yr, N, n0, N); break;
        default: break;
    }
}

template <int KIND>
void run(const float* x, int64_t M, int64_t K, const Blocks16<KIND>& w, int64_t P, float* y, int64_t N) {
    // few rows: four panels a unit (independent chains in flight while the memory streams in);
    // more rows: two panels, tiles of eight rows
    const int64_t np = M <= 2 ? 4 : 2;
    const int64_t units = (P + np - 1) / np;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
            int64_t p = u * np;
            const int64_t stop = std::min(P, p + np);
            if (stop - p == np) {
                if (np == 4) rows_x_panels<4>(x, M, K, w, p, y, N);
                else rows_x_panels<2>(x, M, K, w, p, y, N);
                continue;
            }
            for (; p < stop; ++p) rows_x_panels<1>(x, M, K, w, p, y, N);
        }
    });
}

}  // namespace

bool avx512_usable() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

// x [M, K] fp32 against a weight's blocks (already checked by the caller, few_rows.cpp's
// `block_run`) -> y [M, N].
void block_run512(int kind, const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* d,
                  const void* m, int64_t code_stride, int64_t scale_stride, int64_t P, float* y, int64_t N) {
    const char* dc = static_cast<const char*>(d);
    const char* mc = static_cast<const char*>(m);
    switch (kind) {
        case Q4_0: run<Q4_0>(x, M, K, {codes, dc, mc, code_stride, scale_stride}, P, y, N); break;
        case Q4_1: run<Q4_1>(x, M, K, {codes, dc, mc, code_stride, scale_stride}, P, y, N); break;
        case Q8_0: run<Q8_0>(x, M, K, {codes, dc, mc, code_stride, scale_stride}, P, y, N); break;
        case Q4_K: run<Q4_K>(x, M, K, {codes, dc, mc, code_stride, scale_stride}, P, y, N); break;
        case Q6_K: run<Q6_K>(x, M, K, {codes, dc, mc, code_stride, scale_stride}, P, y, N); break;
        default: TORCH_CHECK(false, "block_run512: unknown block kind");
    }
}
