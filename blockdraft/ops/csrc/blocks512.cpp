// The few-row kernels of few_rows.cpp (`block_linear` over GGUF blocks, `linear` over fp32, bf16
// or int8 panels) with AVX-512: a panel's 16 outputs are one 512-bit vector where AVX2 needs two,
// so a block of codes is widened and dequantized by half the instructions and each row's
// multiply-add covers 16 outputs at once. At one row the AVX2 block kernel is bound by its
// dequantizing instructions, not by memory; at a verify's 16 rows, by its multiply-adds.
//
// Bitwise the AVX2 kernel: the same weights (each dequantized by the same operations: 4-bit kinds
// fma(q, d, m), 8-bit ones d * q), and each output one accumulator over k in order,
// acc = fma(x[m, k], w[k, n], acc) from zero, whatever the row count or the tile a row falls in.
// A panel's fp32, bf16 or int8 weights are widened exactly, an int8 panel's sums multiplied by
// their outputs' scales at the store, as the AVX2 kernel does. Compiled for AVX-512 in this file
// alone; `block_run512` and `panel_run512` run only where the CPU has it (`avx512_usable`), else the
// caller runs the AVX2 kernels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "units.h"

// Only this file's own code is compiled for AVX-512: torch's inline functions, compiled here too,
// must stay what every other file compiles (the linker keeps one copy of each).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,f16c,fma")

namespace {

constexpr int64_t NR = 16;  // outputs per panel: one 512-bit vector
enum BlockKind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q6_K = 4 };  // as few_rows.cpp numbers them

// A weight's blocks as few_rows.cpp's `Blocks` lays them out: codes [P][K][8] bytes (4-bit: output
// j's code in the low nibble of byte j, output j + 8's in the high one) or [P][K][16] int8, and
// d, m [P][K / SPAN][16] (fp16, or fp32 for the K-quants).
template <int KIND>
struct Blocks16 {
    struct Scale { __m512 d, m; };
    static constexpr bool BLOCKS = true;  // (prefetches its next panels' codes and scales)
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

// Sixteen weights as fp32: as they are, widened from bf16 (fp32's upper half: exact) or from int8.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A weight's panels [P][K][16] of fp32, bf16 or int8 (one span: the whole row).
template <typename T>
struct Panels16 {
    struct Scale {};
    static constexpr bool BLOCKS = false;
    static constexpr int64_t SPAN = 0;
    const T* data;
    int64_t stride;  // elements per panel: K * 16
    inline Scale scale(int, int64_t) const { return {}; }
    inline __m512 operator()(int p, int64_t k, Scale) const { return load16(data + p * stride + k * NR); }
    inline Panels16 from(int64_t p) const { return {data + p * stride, stride}; }
};

// An int8 weight's sums times their outputs' scales (none: the sums as they are).
inline __m512 scaled16(__m512 v, const float* scale, int64_t n) {
    return scale == nullptr ? v : _mm512_mul_ps(v, _mm512_loadu_ps(scale + n));
}

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
#define B5_STORE(i, p) if constexpr (MR > i && NP > p) store16(y + i * ldy, n0 + NR * p, N, scaled16(a##i##p, scale, n0 + NR * p));
#define B5_SCALE(p) const typename R::Scale s##p = NP > p ? panels.scale(p, k0) : typename R::Scale{};
#define B5_LOAD(p) const __m512 w##p = NP > p ? panels(p, k, s##p) : _mm512_setzero_ps();
// the next unit's panels (the same thread's next), a cache line of their codes and scales at a time
#define B5_FETCH(p) if constexpr (NP > p) _mm_prefetch(panels.line(NP + p, k), _MM_HINT_T0);
#define B5_FETCH_SCALES(p) if constexpr (NP > p) { _mm_prefetch(panels.scale_line(panels.d, NP + p, k0), _MM_HINT_T0); \
    if constexpr (R::OFFSET) _mm_prefetch(panels.scale_line(panels.m, NP + p, k0), _MM_HINT_T0); }
#define B5_STEP(i) if constexpr (MR > i) { const __m512 xi = _mm512_set1_ps(x[i * ldx + k]); B5_ROW(i, B5_FMA) }

template <int MR, int NP, typename R, bool PREFETCH = false>
inline void tile(const float* x, int64_t ldx, const R& panels, int64_t K, float* y, int64_t ldy, int64_t n0,
                 int64_t N, const float* scale) {
    static_assert(MR <= 8 && NP <= 4 && MR * NP <= 16, "accumulators must fit the registers");
    B5_ROWS(B5_DECL)
    const int64_t span = R::SPAN ? R::SPAN : K;
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        B5_SCALE(0) B5_SCALE(1) B5_SCALE(2) B5_SCALE(3)
        if constexpr (PREFETCH) if ((k0 / R::SPAN) % (64 / (NR * (R::FP32_SCALES ? 4 : 2))) == 0) {
            B5_FETCH_SCALES(0) B5_FETCH_SCALES(1) B5_FETCH_SCALES(2) B5_FETCH_SCALES(3)
        }
        for (int64_t k = k0; k < k0 + span; ++k) {
            if constexpr (PREFETCH) if (k % (64 / R::CODE_BYTES) == 0) { B5_FETCH(0) B5_FETCH(1) B5_FETCH(2) B5_FETCH(3) }
            B5_LOAD(0) B5_LOAD(1) B5_LOAD(2) B5_LOAD(3)
            B5_STEP(0) B5_STEP(1) B5_STEP(2) B5_STEP(3) B5_STEP(4) B5_STEP(5) B5_STEP(6) B5_STEP(7)
        }
    }
    B5_ROWS(B5_STORE)
}

// All M rows of x against NP panels from p0: tiles of 16 / NP rows (at most 8), then the rest.
template <int NP, typename R>
void rows_x_panels(const float* x, int64_t M, int64_t K, const R& packed, int64_t p0, float* y, int64_t N,
                   const float* scale) {
    constexpr int MR = 16 / NP > 8 ? 8 : 16 / NP;
    constexpr bool FETCH = NP == 4 && R::BLOCKS;
    const R panels = packed.from(p0);
    const int64_t n0 = p0 * NR;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile<MR, NP, R>(x + m * K, K, panels, K, y + m * N, N, n0, N, scale);
    const float* xr = x + m * K;
    float* yr = y + m * N;
    switch (M - m) {
        case 7: if constexpr (7 * NP <= 16) tile<7, NP, R>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 6: if constexpr (6 * NP <= 16) tile<6, NP, R>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 5: if constexpr (5 * NP <= 16) tile<5, NP, R>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 4: if constexpr (4 * NP <= 16) tile<4, NP, R>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 3: if constexpr (3 * NP <= 16) tile<3, NP, R>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 2: tile<2, NP, R, FETCH>(xr, K, panels, K, yr, N, n0, N, scale); break;
        case 1: tile<1, NP, R, FETCH>(xr, K, panels, K, yr, N, n0, N, scale); break;
        default: break;
    }
}

template <typename R>
void run(const float* x, int64_t M, int64_t K, const R& w, int64_t P, float* y, int64_t N,
         const float* scale = nullptr) {
    // few rows: four panels a unit (independent chains in flight while the memory streams in);
    // more rows: two panels, tiles of eight rows
    const int64_t np = M <= 2 ? 4 : 2;
    over_units(P, np, [&](int64_t p) {
        if (np == 4) rows_x_panels<4>(x, M, K, w, p, y, N, scale);
        else rows_x_panels<2>(x, M, K, w, p, y, N, scale);
    }, [&](int64_t p) { rows_x_panels<1>(x, M, K, w, p, y, N, scale); });
}

// The fp32 weight [N, K] that P panels of blocks stand for, each weight dequantized by the very
// operations the kernels above use (so bitwise `gguf`'s dequantization): a long prompt's prefill
// multiplies it with oneDNN, made once per call in one pass (torch's ops took seven over the
// weight). Per panel and 16 k: the 16 x 16 weights in a tile, [k][output], each output's 16 k
// then gathered into its row.
template <typename R>
void dequantize_panels(const R& w, int64_t P, int64_t K, float* out, int64_t N) {
    const __m512i down = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float tile[NR * NR];  // [k, output]
        for (int64_t p = begin; p < end; ++p) {
            const R panel = w.from(p);
            const int64_t outputs = std::min(NR, N - p * NR);
            for (int64_t k0 = 0; k0 < K; k0 += NR) {
                const typename R::Scale s = panel.scale(0, k0);  // (a span is 16 or 32 k: one per tile)
                for (int64_t k = 0; k < NR; ++k) _mm512_store_ps(tile + k * NR, panel(0, k0 + k, s));
                for (int64_t o = 0; o < outputs; ++o)
                    _mm512_storeu_ps(out + (p * NR + o) * K + k0, _mm512_i32gather_ps(down, tile + o, 4));
            }
        }
    });
}

}  // namespace

// f(the reader of a weight's blocks, `Blocks16<kind>`), for each of the kinds.
template <typename F>
void with_blocks16(int kind, const uint8_t* codes, const void* d, const void* m, int64_t code_stride,
                   int64_t scale_stride, F&& f) {
    const char* dc = static_cast<const char*>(d);
    const char* mc = static_cast<const char*>(m);
    switch (kind) {
        case Q4_0: f(Blocks16<Q4_0>{codes, dc, mc, code_stride, scale_stride}); break;
        case Q4_1: f(Blocks16<Q4_1>{codes, dc, mc, code_stride, scale_stride}); break;
        case Q8_0: f(Blocks16<Q8_0>{codes, dc, mc, code_stride, scale_stride}); break;
        case Q4_K: f(Blocks16<Q4_K>{codes, dc, mc, code_stride, scale_stride}); break;
        case Q6_K: f(Blocks16<Q6_K>{codes, dc, mc, code_stride, scale_stride}); break;
        default: TORCH_CHECK(false, "blocks512: unknown block kind");
    }
}

// The fp32 weight [N, K] of a weight's blocks (laid out as `block_run512` reads them; K a multiple
// of 32, checked by the caller) into `out`.
void block_dequantize512(int kind, int64_t K, const uint8_t* codes, const void* d, const void* m,
                         int64_t code_stride, int64_t scale_stride, int64_t P, float* out, int64_t N) {
    with_blocks16(kind, codes, d, m, code_stride, scale_stride,
                  [&](const auto& w) { dequantize_panels(w, P, K, out, N); });
}

// x [M, K] fp32 against a weight's blocks (already checked by the caller, few_rows.cpp's
// `block_run`) -> y [M, N].
void block_run512(int kind, const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* d,
                  const void* m, int64_t code_stride, int64_t scale_stride, int64_t P, float* y, int64_t N) {
    with_blocks16(kind, codes, d, m, code_stride, scale_stride, [&](const auto& w) { run(x, M, K, w, P, y, N); });
}

// x [M, K] fp32 against panels [P][K][16] (already checked by few_rows.cpp's `linear`) of fp32
// (dtype 0), bf16 (1) or int8 (2, with `scale` [P * 16]) -> y [M, N].
void panel_run512(int dtype, const float* x, int64_t M, int64_t K, const void* data, int64_t P, float* y, int64_t N,
                  const float* scale) {
    switch (dtype) {
        case 0: run(x, M, K, Panels16<float>{static_cast<const float*>(data), K * NR}, P, y, N); break;
        case 1: run(x, M, K, Panels16<uint16_t>{static_cast<const uint16_t*>(data), K * NR}, P, y, N); break;
        case 2: run(x, M, K, Panels16<int8_t>{static_cast<const int8_t*>(data), K * NR}, P, y, N, scale); break;
        default: TORCH_CHECK(false, "panel_run512: fp32, bf16 or int8 panels");
    }
}

#pragma GCC pop_options

// (outside the AVX-512 code: it runs on every CPU)
bool avx512_usable() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
