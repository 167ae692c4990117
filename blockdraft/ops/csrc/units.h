// How the few-row kernels split a weight's panels across threads: units of np consecutive panels
// (a thread's panels are consecutive, so the next unit is its own next), `full(p)` for a whole
// unit from panel p, `one(p)` for each panel of the last, partial unit.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

template <typename Full, typename One>
void over_units(int64_t P, int64_t np, const Full& full, const One& one) {
    at::parallel_for(0, (P + np - 1) / np, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
            int64_t p = u * np;
            const int64_t stop = std::min(P, p + np);
            if (stop - p == np) {
                full(p);
                continue;
            }
            for (; p < stop; ++p) one(p);
        }
    });
}
