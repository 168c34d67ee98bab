// train_torch: the reference workload (784-512-ReLU-10 MLP, Fashion-MNIST, plain SGD) written as
// an ordinary libtorch module and trained on one device, with dparallel's DataParallel over host
// devices, or with its DDP over thread ranks, through the libtorch adapter
// (<dparallel/adapters/libtorch.hpp>). Flags and JSON summary follow train_mlp's (the subset that
// applies: no --backend cuda, --comm, --init or --resume here).
//
// Every mode visits the same global batches (one seeded permutation per epoch, the last partial
// batch dropped); DDP rank r trains on the r-th equal slice of each global batch, so the three
// modes train the same model up to rounding (examples/CMakeLists.txt checks it).
#include "fashion_mnist.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include "train_torch.hpp"

#include <dparallel/adapters/libtorch.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/spawn.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using example::Mlp;

struct config {
  std::string mode = "single";
  int devices = 0;  // 0: the mode's default
  int epochs = 5;
  std::int64_t global_batch = 128;
  double lr = 0.1;
  std::uint64_t seed = 1;
  std::string data = fashion_mnist::default_dir;
  std::size_t train_samples = 0;  // 0: all
  std::string save;
  bool json = false;
  bool help = false;
};

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: train_torch [options]\n"
               "Trains the 784-512-ReLU-10 MLP, a libtorch module, on Fashion-MNIST with SGD through dparallel.\n"
               "  --mode M           single | dp (DataParallel over --devices host devices) | ddp (DDP over\n"
               "                     --devices thread ranks) (default: single)\n"
               "  --devices N        dp: host devices, ddp: ranks (default: 2; single: 1)\n"
               "  --epochs E         passes over the training images (default: 5)\n"
               "  --batch B          global batch size; ddp: a multiple of --devices (default: 128)\n"
               "  --lr LR            SGD learning rate (default: 0.1)\n"
               "  --seed S           seeds the initialisation and the per-epoch shuffles (default: 1)\n"
               "  --data DIR         folder of the gzip'ed IDX files (default: %s)\n"
               "  --train-samples N  train on the first N training images only (default: all)\n"
               "  --save FILE        save the trained model as a state dict (loads into the PyTorch module\n"
               "                     with load_state_dict)\n"
               "  --json             end with a JSON summary line (train_mlp's keys)\n",
               fashion_mnist::default_dir);
}

template <class T>
T parse_number(std::string_view option, std::string_view text) {
  T v{};
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || !(v > T(0)))
    throw usage_error(std::string(option) + ": expected a positive number, found '" + std::string(text) + "'");
  return v;
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string_view const a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw usage_error(std::string(a) + ": expected a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") c.help = true;
    else if (a == "--json") c.json = true;
    else if (a == "--mode") c.mode = value();
    else if (a == "--devices") c.devices = parse_number<int>(a, value());
    else if (a == "--epochs") c.epochs = parse_number<int>(a, value());
    else if (a == "--batch") c.global_batch = parse_number<std::int64_t>(a, value());
    else if (a == "--lr") c.lr = std::stod(std::string(value()));
    else if (a == "--seed") c.seed = parse_number<std::uint64_t>(a, value());
    else if (a == "--data") c.data = value();
    else if (a == "--train-samples") c.train_samples = parse_number<std::size_t>(a, value());
    else if (a == "--save") c.save = value();
    else throw usage_error("unknown option '" + std::string(a) + "'");
  }
  if (c.mode != "single" && c.mode != "dp" && c.mode != "ddp")
    throw usage_error("--mode: expected single, dp or ddp, found '" + c.mode + "'");
  if (c.devices == 0) c.devices = c.mode == "single" ? 1 : 2;
  if (c.mode == "single" && c.devices != 1) throw usage_error("--mode single runs on one device; drop --devices");
  if (c.mode == "ddp" && c.global_batch % c.devices != 0)
    throw usage_error("--batch " + std::to_string(c.global_batch) + ": ddp splits it into " +
                      std::to_string(c.devices) + " equal rank batches; expected a multiple of --devices");
  return c;
}

struct fingerprint {
  double sum = 0, l2 = 0;
};
fingerprint fingerprint_of(Mlp& m) {
  fingerprint f;
  for (auto const& p : m->parameters()) {
    auto const d = p.detach().to(torch::kDouble);
    f.sum += d.sum().item<double>();
    f.l2 += d.pow(2).sum().item<double>();
  }
  f.l2 = std::sqrt(f.l2);
  return f;
}

struct tensors {
  torch::Tensor images, labels;
};
tensors to_tensors(fashion_mnist::dataset& d) {
  auto const n = static_cast<std::int64_t>(d.size());
  return {torch::from_blob(d.images.data(), {n, 784}, torch::kFloat),
          torch::from_blob(d.labels.data(), {n}, torch::kInt).to(torch::kLong)};
}

double accuracy(Mlp& m, tensors const& test) {
  torch::NoGradGuard const no_grad;
  auto const predicted = m->forward(test.images).argmax(1);
  return predicted.eq(test.labels).to(torch::kDouble).mean().item<double>();
}

using batch_t = std::tuple<torch::Tensor, torch::Tensor>;

struct result {
  double train_loss = 0, test_accuracy = 0, seconds = 0;
  std::uint64_t steps = 0;
  fingerprint params, early;
  std::size_t early_steps = 0;
};
constexpr std::size_t early_steps = 20;

// The training loop every mode shares: `step(batch)` computes the gradient of the batch's mean
// loss into the master (single: by itself; dp / ddp: through the wrapper) and returns the loss.
template <class Step>
result train(config const& c, Mlp& master, tensors const& train_set, Step&& step) {
  torch::optim::SGD opt(master->parameters(), c.lr);
  std::int64_t const n = train_set.images.size(0), batches = n / c.global_batch;
  result r;
  auto const start = std::chrono::steady_clock::now();
  for (int e = 0; e < c.epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed * 1000003 + static_cast<std::uint64_t>(e));
    auto const order = torch::randperm(n, gen, torch::kLong);
    double loss_sum = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      auto const idx = order.narrow(0, b * c.global_batch, c.global_batch);
      batch_t const batch{train_set.images.index_select(0, idx), train_set.labels.index_select(0, idx)};
      loss_sum += step(batch);
      opt.step();
      if (++r.steps == early_steps) {
        r.early_steps = early_steps;
        r.early = fingerprint_of(master);
      }
    }
    r.train_loss = batches == 0 ? 0.0 : loss_sum / static_cast<double>(batches);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.params = fingerprint_of(master);
  if (r.early_steps == 0) {
    r.early_steps = r.steps;
    r.early = r.params;
  }
  return r;
}

double loss_of(Mlp& m, batch_t const& b) {
  auto loss = torch::cross_entropy_loss(m->forward(std::get<0>(b)), std::get<1>(b));
  loss.backward();
  return loss.item<double>();
}

result run(config const& c, Mlp& master, tensors const& train_set) {
  if (c.mode == "single") {
    return train(c, master, train_set, [&](batch_t const& b) {
      master->zero_grad();
      return loss_of(master, b);
    });
  }
  std::vector<dparallel::device> devices;
  for (int i = 0; i < c.devices; ++i) devices.push_back(dparallel::device{dparallel::device_kind::host, i});
  if (c.mode == "dp") {
    dparallel::data_parallel<Mlp> dp(master, devices);
    std::vector<double> losses(devices.size());  // per device: its shard's loss times its weight
    return train(c, master, train_set, [&](batch_t const& b) {
      dp.step(b, [&](Mlp& m, batch_t s, dparallel::step_context& ctx) {
        losses[static_cast<std::size_t>(ctx.replica())] = loss_of(m, s) * ctx.shard_weight();
      });
      double total = 0;
      for (double& l : losses) total += std::exchange(l, 0.0);
      return total;
    });
  }
  // ddp: thread ranks; rank 0's model is `master`, the others train copies of it.
  result out;
  std::vector<Mlp> copies;
  for (int r = 1; r < c.devices; ++r) copies.push_back(dparallel::model_traits<Mlp>::make_replica(master, devices[0]));
  std::int64_t const rank_batch = c.global_batch / c.devices;
  dparallel::spawn(c.devices, [&](dparallel::rank_context& rank) {
    Mlp& mine = rank.rank() == 0 ? master : copies[static_cast<std::size_t>(rank.rank() - 1)];
    dparallel::distributed_data_parallel<Mlp> ddp(mine, rank);
    auto r = train(c, mine, train_set, [&](batch_t const& b) {
      batch_t const slice = dparallel::slice_batch(b, static_cast<std::size_t>(rank.rank() * rank_batch),
                                                   static_cast<std::size_t>((rank.rank() + 1) * rank_batch));
      double loss = 0;
      ddp.step(slice, [&](Mlp& m, batch_t s) { loss = loss_of(m, s); });
      return loss;  // rank 0 reports its own batches' loss, as train_mlp's ddp does
    });
    if (rank.rank() == 0) out = r;
  });
  return out;
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char s[64];
  std::snprintf(s, sizeof s, "%.17g", v);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  try {
    c = parse(argc, argv);
  } catch (usage_error const& e) {
    std::fprintf(stderr, "train_torch: %s\nRun train_torch --help for the options.\n", e.what());
    return 2;
  }
  if (c.help) {
    print_usage(stdout);
    return 0;
  }
  try {
    torch::set_num_threads(1);  // dparallel's devices are the threads
    auto train_data = fashion_mnist::load(c.data, "train",
                                          c.train_samples == 0 ? std::numeric_limits<std::size_t>::max() : c.train_samples);
    auto test_data = fashion_mnist::load(c.data, "t10k");
    tensors const train_set = to_tensors(train_data), test_set = to_tensors(test_data);
    torch::manual_seed(c.seed);
    Mlp master;
    std::printf("train_torch: mode %s on %d host device%s, %zu training / %zu test images, %d epoch%s, batch %lld\n",
                c.mode.c_str(), c.devices, c.devices == 1 ? "" : "s", train_data.size(), test_data.size(), c.epochs,
                c.epochs == 1 ? "" : "s", static_cast<long long>(c.global_batch));
    result const r = run(c, master, train_set);
    double const acc = accuracy(master, test_set);
    double const samples_per_s = static_cast<double>(r.steps) * static_cast<double>(c.global_batch) / r.seconds;
    if (!c.save.empty()) dparallel::save_state_dict(c.save, master);
    std::printf("train_torch: test_accuracy %.4f  train_loss %.4f  samples/s %.0f  param_sum %s  param_l2 %s\n", acc,
                r.train_loss, samples_per_s, number(r.params.sum).c_str(), number(r.params.l2).c_str());
    if (c.json)
      std::printf(
          "{\"mode\":\"%s\",\"backend\":\"host\",\"devices\":%d,\"epochs\":%d,\"global_batch\":%lld,\"lr\":%s,"
          "\"seed\":%llu,\"train_samples\":%zu,\"test_samples\":%zu,\"test_accuracy\":%s,\"train_loss\":%s,"
          "\"samples_per_s\":%s,\"train_seconds\":%s,\"param_sum\":%s,\"param_l2\":%s,\"early_steps\":%zu,"
          "\"early_param_sum\":%s,\"early_param_l2\":%s,\"start_step\":0,\"steps\":%llu}\n",
          c.mode.c_str(), c.devices, c.epochs, static_cast<long long>(c.global_batch), number(c.lr).c_str(),
          static_cast<unsigned long long>(c.seed), train_data.size(), test_data.size(), number(acc).c_str(),
          number(r.train_loss).c_str(), number(samples_per_s).c_str(), number(r.seconds).c_str(),
          number(r.params.sum).c_str(), number(r.params.l2).c_str(), r.early_steps, number(r.early.sum).c_str(),
          number(r.early.l2).c_str(), static_cast<unsigned long long>(r.steps));
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "train_torch: error: %s\n", e.what());
    return 1;
  }
}
