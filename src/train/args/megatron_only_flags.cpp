// Megatron-LM's flag groups with no Megaton counterpart (inference, RL, vision, biencoder,
// distillation, fault injection, ...): each flag has no effect or is refused naming its
// feature (megatron_only_rules.cpp). Nothing to parse.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> megatron_only_megatron_rules();

ArgGroup megatron_only_flags() {
  ArgGroup g{"megatron_only", "Megatron-only features", megatron_only_megatron_rules(), nullptr};
  return g;
}

}  // namespace megaton
