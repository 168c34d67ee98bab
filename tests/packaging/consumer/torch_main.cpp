// A libtorch user's program (built when the consumption test asks for the libtorch adapter):
// DataParallel over two host devices on a torch::nn::Linear. It returns 0 only when the master's
// gradients equal those of the module run by libtorch alone on the whole batch.
#include <dparallel/adapters/libtorch.hpp>
#include <dparallel/dparallel.hpp>

#include <cstdio>
#include <tuple>

int main() {
  torch::manual_seed(1);
  torch::nn::Linear net(4, 2), alone(4, 2);
  net->to(torch::kDouble);
  alone->to(torch::kDouble);
  {
    torch::NoGradGuard const no_grad;
    alone->weight.copy_(net->weight);
    alone->bias.copy_(net->bias);
  }
  using batch = std::tuple<torch::Tensor, torch::Tensor>;
  torch::Tensor const x = torch::randn({8, 4}, torch::kDouble), y = torch::randn({8, 2}, torch::kDouble);
  dparallel::data_parallel<torch::nn::Linear> dp(net, dparallel::host::devices(2));
  dp.step(batch{x, y}, [](torch::nn::Linear& m, batch b) {
    torch::mse_loss(m->forward(std::get<0>(b)), std::get<1>(b)).backward();
  });
  torch::mse_loss(alone->forward(x), y).backward();
  double const diff = (net->weight.grad() - alone->weight.grad()).abs().max().item<double>() +
                      (net->bias.grad() - alone->bias.grad()).abs().max().item<double>();
  std::printf("libtorch consumer: DataParallel over 2 devices, gradient difference %.3g\n", diff);
  return diff < 1e-12 ? 0 : 1;
}
