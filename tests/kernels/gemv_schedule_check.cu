// gemv.cu's schedule functions (chunk_of, chunks_of, gdn_rows, gdn_awaited, down_run) run on the CPU: the very code the kernels
// call, compiled into a host program (tests/kernels/test_gemv_gdn.py builds and runs it where nvcc is).
//   gemv_schedule_check gdn N HK HV GRID B_OFF A_OFF ROT WAVES EARLY   (EARLY 1: every head's rows in the first
//                                                                       WAVES rounds)
//   gemv_schedule_check down TOP_K ROWS DPP GRID
// prints OK, or the first broken rule and exits 1.
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "gemv.cu"

static int fail(const char* what, int a, int b) {
  std::printf("FAIL %s (%d, %d)\n", what, a, b);
  return 1;
}

static int check_gdn(int n_rows, int hk, int hv, int grid, int b_off, int a_off, int rot, int waves, int early) {
  const int n = n_rows / ROWS;
  Gdn g{};
  g.hv = hv, g.hk = hk, g.b_off = b_off, g.a_off = a_off, g.rot = rot, g.waves = waves;
  std::vector<int> seen(n, 0);
  std::vector<long> rows(hv, 0), first(hv, 0);
  for (int b = 0; b < grid; ++b) {
    int k = 0, c;
    for (; (c = chunk_of(b, k, grid, n, hv, waves)) >= 0; ++k) {
      seen[c] += 1;
      const int p = (c + rot) % n;
      int any = 0;
      for (int h = 0; h < hv; ++h) {
        const int r = gdn_rows(g, p * ROWS, h);
        rows[h] += r;
        any += r;
        if (c < waves * grid) first[h] += r;
      }
      if (any > 0 && !gdn_awaited(g, p * ROWS)) return fail("a chunk some head reads is not counted", c, p);
    }
    for (int j = k; j < k + 64; ++j)
      if (chunk_of(b, j, grid, n, hv, waves) >= 0) return fail("a CTA's chunks are not a prefix of k", b, j);
    if (b < hv && k != imin(waves, chunks_of(b, grid, n))) return fail("an updater's chunk count (k0)", b, k);
  }
  for (int c = 0; c < n; ++c)
    if (seen[c] != 1) return fail("a chunk not taken exactly once", c, seen[c]);
  for (int h = 0; h < hv; ++h) {
    if (rows[h] != GDN_ROWS) return fail("a head's count", h, static_cast<int>(rows[h]));
    if (early && first[h] != GDN_ROWS) return fail("a head's rows past the first rounds", h, static_cast<int>(first[h]));
  }
  return 0;
}

static int check_down(int top_k, int rows, int dpp, int grid) {
  const int n_gu = (top_k + 1) * rows / ROWS, n_dn = (top_k + 1) * dpp, cpp = rows / ROWS;
  grid = imin(grid, n_gu);
  std::vector<int> seen(n_dn, 0), pair(top_k + 1, 0);
  int prev_hi = 0;
  for (int b = 0; b < grid; ++b) {
    int k = 0;  // the producer's gate/up landings (c = b, b + grid, ... < n_gu), as gemv_body's MOE loops
    for (int c = b; c < n_gu; c += grid, ++k) pair[c / cpp] += 1;
    if (k != chunks_of(b, grid, n_gu)) return fail("a CTA's gate/up chunk count (the down run's first it)", b, k);
    for (int j = 0; j < k; ++j)
      if (chunk_of(b, j, grid, n_gu, 0, 0) != b + j * grid) return fail("chunk_of without GDN", b, j);
    int lo, hi;
    down_run(b, grid, n_dn, lo, hi);
    if (lo != prev_hi || hi < lo) return fail("the down runs are not consecutive", b, lo);
    prev_hi = hi;
    for (int d = lo; d < hi; ++d) seen[d] += 1;
  }
  if (prev_hi != n_dn) return fail("the down runs end short", prev_hi, n_dn);
  for (int d = 0; d < n_dn; ++d)
    if (seen[d] != 1) return fail("a down chunk not taken exactly once", d, seen[d]);
  for (int q = 0; q <= top_k; ++q)
    if (pair[q] != cpp) return fail("a pair's gate/up count", q, pair[q]);
  return 0;
}

int main(int argc, char** argv) {
  std::vector<int> a;
  for (int i = 2; i < argc; ++i) a.push_back(std::atoi(argv[i]));
  int rc = 2;
  if (argc == 11 && std::string_view(argv[1]) == "gdn") rc = check_gdn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]);
  if (argc == 6 && std::string_view(argv[1]) == "down") rc = check_down(a[0], a[1], a[2], a[3]);
  if (rc == 2) std::printf("usage: see the header\n");
  if (rc == 0) std::printf("OK\n");
  return rc;
}
