// Must NOT compile: DataParallel over a libtorch module that is not torch::nn::Cloneable (its
// replicas are made with Module::clone(), which such a module only fails at run time). Expected:
// the libtorch adapter's static_assert in model_traits<M>::make_replica. (DDP needs no replica and
// takes such modules: test_libtorch_semantics.)
#include <dparallel/adapters/libtorch.hpp>
#include <dparallel/dparallel.hpp>

struct PlainImpl : torch::nn::Module {
  PlainImpl() : fc(register_module("fc", torch::nn::Linear(6, 3))) {}
  torch::nn::Linear fc;
};
TORCH_MODULE(Plain);

int main() {
  Plain net;
  dparallel::data_parallel<Plain> dp(net, dparallel::host::devices(2));
  return 0;
}
