// GGUF blocks times activations quantized to int8: the opt-in faster mode of a GGUF target
// (ops/int8_activations.py), in the manner of llama.cpp's quantized dot products (activations in
// int8 blocks of 32 with an fp32 scale; llama.cpp's K-quant paths use blocks of 256). Not the
// fp32 weights' result (the exact kernel is blocks512.cpp / few_rows.cpp): each row of x is
// quantized in blocks of 32 inputs to int8 with one fp32 scale, each span of a weight's codes is
// multiplied by those int8 values with integer dot products (AVX-512 VNNI: 64 products an
// instruction, where the exact kernel widens every weight to fp32), and only the span's sum is
// scaled in fp32:
//     y[n] += d[n] * (dx * (sum_k q[n, k] qx[k] - OFF sum_k qx[k])) + m[n] * (dx * sum_k qx[k])
// with the kind's dequantization w = d * (q - OFF) + m (Q4_0: m = -8 d; Q4_1, Q4_K: m stored; Q8_0
// and Q6_K: the int8 codes made unsigned by OFF = 128 / 32, m = 0). A row's result depends on that
// row alone, in one fixed order, whatever the number of rows: speculative decoding in this mode
// equals plain decoding in this mode bit for bit.
//
// The codes are laid out once for the dot products (`pack_vnni`): per panel of 16 outputs, a
// 64-byte line per group of inputs, output j's codes for inputs k .. k+3 in bytes 4j .. 4j+3
// (4-bit kinds: inputs k+4 .. k+7 in the same bytes' high nibbles: a line covers 8 inputs).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

#include "units.h"

// Only this file's own code is compiled for AVX-512 VNNI (see blocks512.cpp).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

namespace {

constexpr int64_t NR = 16;
constexpr int64_t QB = 32;  // activations: one scale per 32 inputs
enum BlockKind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q6_K = 4 };  // as few_rows.cpp numbers them

template <int KIND>
struct Kind {
    static constexpr bool EIGHT_BIT = KIND == Q8_0 || KIND == Q6_K;
    static constexpr bool FP32_SCALES = KIND == Q4_K || KIND == Q6_K;
    static constexpr bool STORED_M = KIND == Q4_1 || KIND == Q4_K;
    static constexpr bool HAS_M = STORED_M || KIND == Q4_0;
    static constexpr int64_t SPAN = KIND == Q6_K ? 16 : 32;
    static constexpr int OFF = KIND == Q8_0 ? 128 : (KIND == Q6_K ? 32 : 0);
    static constexpr int64_t GROUP = EIGHT_BIT ? 4 : 8;  // inputs per 64-byte line
};

// The rows of x quantized: q [M, K] int8, d [M, K / 32] (the scale), s [M, K / 16] (sum of q over 16).
struct QRows {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s;
    int64_t K;
};

QRows quantize(const float* x, int64_t M, int64_t K) {
    QRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / QB)), std::vector<int32_t>(M * (K / 16)), K};
    for (int64_t i = 0; i < M * (K / QB); ++i) {
        const float* xb = x + i * QB;
        float amax = 0.f;
        for (int64_t j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        r.d[i] = d;
        int32_t s0 = 0, s1 = 0;
        for (int64_t j = 0; j < QB; ++j) {
            const int v = static_cast<int>(std::nearbyint(xb[j] * id));
            const int8_t q = static_cast<int8_t>(std::max(-127, std::min(127, v)));
            r.q[i * QB + j] = q;
            (j < 16 ? s0 : s1) += q;
        }
        r.s[2 * i] = s0;
        r.s[2 * i + 1] = s1;
    }
    return r;
}

template <int KIND>
inline __m512 load_scale(const void* base, int64_t s) {
    if constexpr (Kind<KIND>::FP32_SCALES)
        return _mm512_loadu_ps(static_cast<const float*>(base) + s);
    else
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + s)));
}

// MR rows against NP panels from the unit's first: y[i, 16 p + j] for each.
template <int KIND, int MR, int NP>
void tile(const QRows& qr, int64_t m0, const uint8_t* vnni, int64_t line_stride, const void* d, const void* m,
          int64_t scale_stride, int64_t p0, float* y, int64_t N) {
    using T = Kind<KIND>;
    const int64_t K = qr.K, G = T::SPAN / T::GROUP;  // lines per span
    __m512 acc[MR][NP];
    for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t k0 = 0; k0 < K; k0 += T::SPAN) {
        __m512i dot[MR][NP];
        for (int i = 0; i < MR; ++i)
            for (int p = 0; p < NP; ++p) dot[i][p] = _mm512_setzero_si512();
        for (int64_t g = 0; g < G; ++g) {
            const int64_t k = k0 + g * T::GROUP, line = k / T::GROUP;
            __m512i a[NP], b[NP];
            for (int p = 0; p < NP; ++p) {
                const __m512i v = _mm512_loadu_si512(vnni + ((p0 + p) * line_stride + line) * 64);
                if constexpr (T::EIGHT_BIT) {
                    a[p] = v;
                } else {
                    a[p] = _mm512_and_si512(v, low);
                    b[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            }
            for (int i = 0; i < MR; ++i) {
                const int8_t* q = qr.q.data() + (m0 + i) * K + k;
                int32_t w0, w1;
                std::memcpy(&w0, q, 4);
                const __m512i x0 = _mm512_set1_epi32(w0);
                for (int p = 0; p < NP; ++p) dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], a[p], x0);
                if constexpr (!T::EIGHT_BIT) {
                    std::memcpy(&w1, q + 4, 4);
                    const __m512i x1 = _mm512_set1_epi32(w1);
                    for (int p = 0; p < NP; ++p) dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], b[p], x1);
                }
            }
        }
        for (int p = 0; p < NP; ++p) {
            const int64_t s = (p0 + p) * scale_stride + (k0 / T::SPAN) * NR;
            const __m512 dw = load_scale<KIND>(d, s);
            __m512 mw = _mm512_setzero_ps();
            if constexpr (T::STORED_M) mw = load_scale<KIND>(m, s);
            if constexpr (KIND == Q4_0) mw = _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
            for (int i = 0; i < MR; ++i) {
                const int64_t row = m0 + i;
                const float dx = qr.d[row * (K / QB) + k0 / QB];
                const int32_t* s16 = qr.s.data() + row * (K / 16) + k0 / 16;
                const int32_t sq = T::SPAN == 32 ? s16[0] + s16[1] : s16[0];
                const __m512i sum = _mm512_sub_epi32(dot[i][p], _mm512_set1_epi32(T::OFF * sq));
                const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx));
                acc[i][p] = _mm512_fmadd_ps(dw, t, acc[i][p]);
                if constexpr (T::HAS_M) acc[i][p] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(sq)), acc[i][p]);
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p) {
            const int64_t n = (p0 + p) * NR;
            float* row = y + (m0 + i) * N;
            if (n + NR <= N) _mm512_storeu_ps(row + n, acc[i][p]);
            else if (n < N) _mm512_mask_storeu_ps(row + n, static_cast<__mmask16>((1u << (N - n)) - 1), acc[i][p]);
        }
}

template <int KIND, int NP>
void rows_x_panels(const QRows& qr, int64_t M, const uint8_t* vnni, int64_t line_stride, const void* d,
                   const void* m, int64_t scale_stride, int64_t p0, float* y, int64_t N) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) tile<KIND, 4, NP>(qr, r, vnni, line_stride, d, m, scale_stride, p0, y, N);
    switch (M - r) {
        case 3: tile<KIND, 3, NP>(qr, r, vnni, line_stride, d, m, scale_stride, p0, y, N); break;
        case 2: tile<KIND, 2, NP>(qr, r, vnni, line_stride, d, m, scale_stride, p0, y, N); break;
        case 1: tile<KIND, 1, NP>(qr, r, vnni, line_stride, d, m, scale_stride, p0, y, N); break;
        default: break;
    }
}

template <int KIND>
void run(const QRows& qr, int64_t M, const uint8_t* vnni, const void* d, const void* m, int64_t P, float* y,
         int64_t N) {
    using T = Kind<KIND>;
    const int64_t K = qr.K, line_stride = K / T::GROUP, scale_stride = K / T::SPAN * NR;
    const int64_t np = M <= 2 ? 4 : 2;
    over_units(P, np, [&](int64_t p) {
        if (np == 4) rows_x_panels<KIND, 4>(qr, M, vnni, line_stride, d, m, scale_stride, p, y, N);
        else rows_x_panels<KIND, 2>(qr, M, vnni, line_stride, d, m, scale_stride, p, y, N);
    }, [&](int64_t p) { rows_x_panels<KIND, 1>(qr, M, vnni, line_stride, d, m, scale_stride, p, y, N); });
}

}  // namespace

bool q8_usable();

// codes [P, K, 8] uint8 (4-bit kinds) or [P, K, 16] int8 (Q8_0, Q6_K) -> [P, K / group, 64] uint8
// (the layout above).
torch::Tensor pack_vnni(torch::Tensor codes, int64_t kind) {
    const bool eight = kind == Q8_0 || kind == Q6_K;
    TORCH_CHECK(codes.dim() == 3 && codes.size(2) == (eight ? 16 : 8) && codes.is_contiguous() && codes.element_size() == 1 &&
                codes.size(1) % 32 == 0, "pack_vnni: codes [P, K, 8 or 16] of a block kind");
    const int64_t P = codes.size(0), K = codes.size(1), group = eight ? 4 : 8;
    const int off = kind == Q8_0 ? 128 : (kind == Q6_K ? 32 : 0);
    auto out = torch::empty({P, K / group, 64}, codes.options().dtype(torch::kUInt8));
    const uint8_t* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
    uint8_t* o = out.data_ptr<uint8_t>();
    auto code = [&](int64_t p, int64_t k, int64_t j) -> int {  // output j's code at input k
        if (eight) return static_cast<int>(reinterpret_cast<const int8_t*>(c)[(p * K + k) * 16 + j]) + off;
        const uint8_t b = c[(p * K + k) * 8 + (j % 8)];
        return j < 8 ? (b & 0x0F) : (b >> 4);
    };
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p)
            for (int64_t g = 0; g < K / group; ++g)
                for (int64_t j = 0; j < NR; ++j)
                    for (int64_t i = 0; i < 4; ++i) {
                        const int64_t k = g * group + i;
                        const int v = eight ? code(p, k, j) : code(p, k, j) | (code(p, k + 4, j) << 4);
                        o[(p * (K / group) + g) * 64 + 4 * j + i] = static_cast<uint8_t>(v);
                    }
    });
    return out;
}

// x [M, K] fp32 against a weight's VNNI codes (`pack_vnni`) and its blocks' d and m (as
// `block_linear` takes them) -> y [M, N] fp32, x quantized to int8 per row and block of 32.
torch::Tensor block_linear_q8(torch::Tensor x, torch::Tensor vnni, torch::Tensor d, torch::Tensor m, int64_t N,
                              int64_t kind) {
    TORCH_CHECK(q8_usable(), "block_linear_q8: int8 activations need AVX-512 VNNI");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % QB == 0,
                "block_linear_q8: 2-D float32 rows, a multiple of 32 wide");
    x = x.contiguous();
    const int64_t M = x.size(0), K = x.size(1), P = vnni.size(0);
    const bool eight = kind == Q8_0 || kind == Q6_K;
    TORCH_CHECK(vnni.dim() == 3 && vnni.size(1) == K / (eight ? 4 : 8) && vnni.size(2) == 64 && vnni.is_contiguous(),
                "block_linear_q8: codes packed by pack_vnni for this input width");
    TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "block_linear_q8: N does not match the packed weight");
    const bool fp32_scales = kind == Q4_K || kind == Q6_K;
    const int64_t span = kind == Q6_K ? 16 : 32;
    TORCH_CHECK(d.scalar_type() == (fp32_scales ? torch::kFloat32 : torch::kHalf) && d.is_contiguous() &&
                d.numel() == P * (K / span) * NR, "block_linear_q8: d [P, K / span, 16] of the kind's scale type");
    const bool stored_m = kind == Q4_1 || kind == Q4_K;
    TORCH_CHECK(!stored_m || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.sizes() == d.sizes()),
                "block_linear_q8: Q4_1 and Q4_K need m shaped as d");
    auto y = torch::empty({M, N}, x.options());
    const QRows qr = quantize(x.data_ptr<float>(), M, K);
    const uint8_t* v = vnni.data_ptr<uint8_t>();
    const void* mp = stored_m ? m.data_ptr() : nullptr;
    float* yp = y.data_ptr<float>();
    switch (kind) {
        case Q4_0: run<Q4_0>(qr, M, v, d.data_ptr(), mp, P, yp, N); break;
        case Q4_1: run<Q4_1>(qr, M, v, d.data_ptr(), mp, P, yp, N); break;
        case Q8_0: run<Q8_0>(qr, M, v, d.data_ptr(), mp, P, yp, N); break;
        case Q4_K: run<Q4_K>(qr, M, v, d.data_ptr(), mp, P, yp, N); break;
        case Q6_K: run<Q6_K>(qr, M, v, d.data_ptr(), mp, P, yp, N); break;
        default: TORCH_CHECK(false, "block_linear_q8: kind is Q4_0, Q4_1, Q8_0, Q4_K or Q6_K");
    }
    return y;
}

#pragma GCC pop_options

// (outside the AVX-512 code: it runs on every CPU)
bool q8_usable() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}
