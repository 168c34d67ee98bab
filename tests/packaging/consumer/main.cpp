// A user's program: DataParallel over two host devices on a two-parameter model. It returns 0
// only when the reduced gradient on the master equals the one-device gradient exactly, so the
// packaging tests prove that the library found this way is complete and works, not just that it
// compiles.
#include <dparallel/dparallel.hpp>

#include <array>
#include <cstddef>
#include <cstdio>
#include <span>
#include <vector>

namespace {

struct sample {
  float x;
  float y;
};

// y ~ w * x + b with loss 0.5 * (w * x + b - y)^2, averaged over the samples of a shard.
struct line {
  std::vector<float> w{1.0F}, b{0.0F}, gw{0.0F}, gb{0.0F};
  auto parameters() { return std::array{dparallel::view(w), dparallel::view(b)}; }
  auto gradients() { return std::array{dparallel::view(gw), dparallel::view(gb)}; }

  void forward_backward(std::span<sample const> shard) {
    float sw = 0.0F;
    float sb = 0.0F;
    for (auto const& s : shard) {
      float const r = w[0] * s.x + b[0] - s.y;
      sw += r * s.x;
      sb += r;
    }
    gw[0] = sw / static_cast<float>(shard.size());
    gb[0] = sb / static_cast<float>(shard.size());
  }
};

}  // namespace

int check_files();  // files.cpp

int main() {
  line model;
  dparallel::data_parallel<line> dp(model, dparallel::host::devices(2));

  // Residuals r = x (w = 1, b = 0, y = 0): dL/dw = mean(x^2) = 30 / 4, dL/db = mean(x) = 10 / 4.
  // Shards {1, 2} and {3, 4} each weigh 1/2; every intermediate value is exact in float.
  std::vector<sample> const batch{{1.0F, 0.0F}, {2.0F, 0.0F}, {3.0F, 0.0F}, {4.0F, 0.0F}};
  dp.step(batch, [](line& replica, std::span<sample const> shard, dparallel::step_context&) {
    replica.forward_backward(shard);
  });

  std::vector<std::size_t> const expected_shards{2, 2};
  if (dp.last_shard_sizes() != expected_shards) {
    std::fprintf(stderr, "consumer: expected shards of 2 and 2 samples over 2 devices\n");
    return 1;
  }
  if (dp.module().gw[0] != 7.5F || dp.module().gb[0] != 2.5F) {
    std::fprintf(stderr, "consumer: expected gradients (7.5, 2.5), found (%.9g, %.9g)\n",
                 static_cast<double>(dp.module().gw[0]), static_cast<double>(dp.module().gb[0]));
    return 1;
  }
  if (check_files() != 0) return 1;
  std::printf("consumer: dparallel %d.%d.%d OK, gradients (7.5, 2.5), files read back\n", DPARALLEL_VERSION_MAJOR,
              DPARALLEL_VERSION_MINOR, DPARALLEL_VERSION_PATCH);
  return 0;
}
