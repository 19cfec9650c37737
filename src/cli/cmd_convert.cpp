// `megaton convert`: Hugging Face model directories <-> Megaton checkpoints.
//   megaton convert --from hf DIR --save OUT [--target-tensor-model-parallel-size N ...]
//   megaton convert --load CKPT --to hf OUT [--export-dtype bf16|fp32]
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "train/hf_convert.h"

namespace megaton::cli {

void add_convert_command(CLI::App& app) {
  struct State {
    std::vector<std::string> from, to;
    std::string save, load, export_dtype = "bf16";
    TargetLayout target;
    int64_t make_vocab_size_divisible_by = 128;
    int64_t max_shard_bytes = 5'000'000'000;
  };
  auto s = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "convert",
      "convert a Hugging Face model directory to a Megaton checkpoint (--from hf DIR --save "
      "OUT) or back (--load CKPT --to hf OUT)");
  cmd->add_option("--from", s->from,
                  "FORMAT DIR: the model to read; FORMAT is hf (config.json, *.safetensors, "
                  "tokenizer files)")
      ->expected(2);
  cmd->add_option("--save", s->save,
                  "with --from: the checkpoint directory to write (absent or empty); iteration 0, "
                  "weights only");
  cmd->add_option("--target-tensor-model-parallel-size", s->target.tp,
                  "with --from: write the checkpoint as this many tensor-parallel ranks would "
                  "(default 1; any layout loads it)");
  cmd->add_option("--target-pipeline-model-parallel-size", s->target.pp,
                  "with --from: pipeline stages to write for (default 1)");
  cmd->add_option("--target-expert-model-parallel-size", s->target.ep,
                  "with --from: expert-parallel ranks to write for (default 1)");
  cmd->add_option("--target-expert-tensor-parallel-size", s->target.etp,
                  "with --from: expert-tensor-parallel size (default: the tensor-parallel size)");
  cmd->add_option("--make-vocab-size-divisible-by", s->make_vocab_size_divisible_by,
                  "with --from: pad the vocabulary to a multiple of this x the tensor-parallel "
                  "size (default 128, Megatron's)");
  cmd->add_option("--load", s->load, "with --to: the Megaton checkpoint directory to read");
  cmd->add_option("--to", s->to,
                  "FORMAT OUT: the model to write; FORMAT is hf (a directory, absent or empty)")
      ->expected(2);
  cmd->add_option("--export-dtype", s->export_dtype,
                  "with --to: bf16 (default) or fp32 tensors in the safetensors files");
  cmd->add_option("--max-shard-size", s->max_shard_bytes,
                  "with --to: bytes per safetensors file before the next one starts (default "
                  "5000000000, Hugging Face's 5GB)");
  cmd->callback([s] {
    const auto say = [](const std::string& line) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    };
    const bool from = !s->from.empty(), to = !s->to.empty();
    if (from == to)
      fail("convert needs one of --from hf DIR (with --save) and --to hf OUT (with --load)");
    if (from) {
      if (s->from[0] != "hf")
        fail("--from {}: only hf (a Hugging Face model directory) is read", s->from[0]);
      if (s->save.empty()) fail("--from hf needs --save OUT");
      if (!s->load.empty()) fail("--load goes with --to, not --from");
      if (s->make_vocab_size_divisible_by < 1)
        fail("--make-vocab-size-divisible-by must be >= 1 (got {})",
             s->make_vocab_size_divisible_by);
      HFImportOptions o;
      o.hf_dir = s->from[1];
      o.save_dir = s->save;
      o.target = s->target;
      o.make_vocab_size_divisible_by = s->make_vocab_size_divisible_by;
      import_hf_checkpoint(o, say);
      return;
    }
    if (s->to[0] != "hf")
      fail("--to {}: only hf (a Hugging Face model directory) is written", s->to[0]);
    if (s->load.empty()) fail("--to hf needs --load CKPT");
    if (!s->save.empty()) fail("--save goes with --from, not --to");
    HFExportOptions o;
    o.load_dir = s->load;
    o.out_dir = s->to[1];
    if (s->export_dtype == "bf16")
      o.dtype = DType::BF16;
    else if (s->export_dtype == "fp32")
      o.dtype = DType::F32;
    else
      fail("--export-dtype must be bf16 or fp32 (got '{}')", s->export_dtype);
    o.max_shard_bytes = s->max_shard_bytes;
    export_hf_checkpoint(o, say);
  });
}

}  // namespace megaton::cli
