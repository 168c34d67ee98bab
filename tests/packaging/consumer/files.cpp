// The consumer's use of the io headers: a two-tensor model saved as a state dict and as a training
// checkpoint, read back into a fresh model, compared exactly; and DDP's options written with the
// documented designated-initialiser idiom. Built with -Wall -Wextra -Werror at the consumer's
// optimisation level (the Release test: -O3), where GCC inlines the header writer.
#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/state_dict.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

namespace {

struct two_layers {
  std::vector<float> w{0.5F, -1.25F, 2.0F, 3.0F, 4.0F, -0.75F}, b{0.25F, 1.5F};
  std::vector<float> gw = std::vector<float>(6), gb = std::vector<float>(2);
  auto parameters() { return std::array{dparallel::view(w), dparallel::view(b)}; }
  auto gradients() { return std::array{dparallel::view(gw), dparallel::view(gb)}; }
  static auto parameter_names() { return std::array{"fc.weight", "fc.bias"}; }
};

}  // namespace

/// 0 when the state dict and the checkpoint read back to the bit (and the options build); else 1.
int check_files() {
  dparallel::options const ddp_options{.bucket_cap_mb = 25};  // no -Wmissing-field-initializers
  if (ddp_options.bucket_cap_mb != 25.0 || ddp_options.local_device.has_value()) return 1;

  std::filesystem::path const dir =
      std::filesystem::temp_directory_path() / ("dparallel_consumer_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  two_layers saved;
  two_layers from_dict, from_checkpoint;
  for (auto* m : {&from_dict, &from_checkpoint}) {
    m->w.assign(6, 0.0F);
    m->b.assign(2, 0.0F);
  }
  dparallel::save_state_dict((dir / "model.safetensors").string(), saved);
  dparallel::load_state_dict((dir / "model.safetensors").string(), from_dict);
  dparallel::checkpoint out(saved);
  out.progress().step = 7;
  out.save((dir / "model.ckpt.safetensors").string());
  dparallel::checkpoint in(from_checkpoint);
  in.load((dir / "model.ckpt.safetensors").string());
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);

  bool const same = from_dict.w == saved.w && from_dict.b == saved.b && from_checkpoint.w == saved.w &&
                    from_checkpoint.b == saved.b && in.progress().step == 7;
  if (!same) std::fprintf(stderr, "consumer: the state dict or checkpoint did not read back as saved\n");
  return same ? 0 : 1;
}
