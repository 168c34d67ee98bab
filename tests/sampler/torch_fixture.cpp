// Prints, as JSON, what distributed_sampler gives every rank over a grid of cases (dataset sizes,
// replica counts, shuffle, drop_last, seeds, epochs) with the default (torch) order, for
// tests/sampler/check_torch.py to compare with PyTorch's DistributedSampler.
#include <dparallel/data/distributed_sampler.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

int main() {
  std::string out = "[";
  bool first = true;
  std::vector<std::size_t> const lengths{0, 1, 2, 7, 10, 33, 100, 1000, 60000};
  std::vector<std::uint64_t> const seeds{0, 1, 42, 4294967301ull};  // the last: 2^32 + 5
  for (std::size_t len : lengths) {
    for (int n : {1, 2, 3, 4, 7}) {
      for (bool shuffle : {true, false}) {
        for (bool drop_last : {false, true}) {
          for (std::uint64_t seed : seeds) {
            if (!shuffle && seed != 0) continue;  // the seed plays no part
            for (std::uint64_t epoch : {0ull, 1ull, 5ull}) {
              out += first ? "\n" : ",\n";
              first = false;
              out += "{\"len\":" + std::to_string(len) + ",\"replicas\":" + std::to_string(n) +
                     ",\"shuffle\":" + (shuffle ? "true" : "false") +
                     ",\"drop_last\":" + (drop_last ? "true" : "false") + ",\"seed\":" + std::to_string(seed) +
                     ",\"epoch\":" + std::to_string(epoch) + ",\"ranks\":[";
              for (int rank = 0; rank < n; ++rank) {
                dparallel::distributed_sampler s(len, n, rank,
                                                 {.shuffle = shuffle, .seed = seed, .drop_last = drop_last});
                s.set_epoch(epoch);
                out += rank == 0 ? "[" : ",[";
                for (std::size_t k = 0; k < s.size(); ++k) out += (k == 0 ? "" : ",") + std::to_string(s.indices()[k]);
                out += "]";
              }
              out += "]}";
            }
          }
        }
      }
    }
  }
  out += "\n]\n";
  std::fputs(out.c_str(), stdout);
  return 0;
}
