// Exhaustive checks of the NVFP4 encoder's division-free E2M1 path (sparkinfer/records.h) against the
// spec's arithmetic, an fp32 division and the E2M1 thresholds compared one by one:
//   1. e2m1_biased: the code of every fp32 a in [0, 6];
//   2. e2m1_codes8 with e2m1_divisor: for every divisor mantissa m1 in [1, 2), the codes of x / m1 for
//      every x within 6 ulps of each E2M1 boundary t times m1 (the only x whose code the quotient's
//      last bit can change), both signs.
// Build and run (a few seconds in full; STRIDE > 1 samples every STRIDE-th value, as the test does):
//   g++ -O2 -std=c++17 -ffp-contract=off -fno-fast-math -I csrc/include csrc/tools/check_nvfp4_codes.cpp -o check
//   ./check [STRIDE]
#include <stdio.h>
#include <stdlib.h>

#include "sparkinfer/records.h"

namespace {

int spec_code(float q) {  // the spec's E2M1 magnitude of an fp32 quotient, threshold by threshold
  const float a = fabsf(q);
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t stride = argc > 1 ? (uint32_t)atoi(argv[1]) : 1u;
  long checked = 0, bad = 0;
  for (uint32_t b = 0; b <= si::f32_bits(6.0f); b += stride) {
    const float a = si::bits_f32(b);
    ++checked;
    if ((int)si::e2m1_magnitude(a) != spec_code(a) && bad++ < 5) printf("e2m1 a=%a\n", a);
  }
  const float t[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (uint32_t mm = 0; mm < (1u << 23); mm += stride) {
    const float m = si::bits_f32(0x3f800000u | mm);
    const si::E2m1Divisor d = si::e2m1_divisor(m);
    for (int k = 0; k < 7; ++k) {
      float x[8];
      for (int u = -6; u <= 6; u += 2) {  // a word: u and u + 1 ulps from RN(t m), both signs
        for (int i = 0; i < 8; ++i) {
          const int off = u + (i % 2);
          x[i] = si::bits_f32(si::f32_bits(t[k] * m) + off) * (i < 4 ? 1.0f : -1.0f);
        }
        const uint32_t w = si::e2m1_codes8(x, d);
        for (int i = 0; i < 8; ++i) {
          const int c = spec_code(x[i] / m);
          const uint32_t want = (uint32_t)(c != 0 && x[i] < 0.0f ? c | 8 : c);
          ++checked;
          if (((w >> (4 * i)) & 15u) != want && bad++ < 10) printf("quotient m=%a x=%a\n", m, x[i]);
        }
      }
    }
  }
  printf("%ld checked, %ld wrong\n", checked, bad);
  return bad != 0;
}
