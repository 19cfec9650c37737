// `megaton convert`: a Hugging Face model directory -> a Megaton checkpoint, and back.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "core/tensor.h"
#include "train/layout_writer.h"

namespace megaton {

// Receives the lines a conversion prints (what it wrote, warnings).
using ConvertLog = std::function<void(const std::string&)>;

// The options of `megaton convert --from hf DIR --save OUT`.
struct HFImportOptions {
  std::string hf_dir;    // config.json, *.safetensors (with model.safetensors.index.json when
                         // sharded), optionally tokenizer.json + tokenizer_config.json or
                         // tokenizer.model
  std::string save_dir;  // OUT: absent or an empty directory
  TargetLayout target;   // --target-*-parallel-size
  int64_t make_vocab_size_divisible_by = 128;
  // The checkpoint names the tokenizer files where they are in hf_dir instead of copying
  // them to OUT/tokenizer/ (`megaton train --load` of a Hugging Face directory).
  bool tokenizer_in_place = false;
};

// Reads the Hugging Face model (BF16, F16 or F32 tensors, converted to F32), maps its
// names (ckpt::hf_to_megaton, flags from config.json: train/hf_config.h) and writes
// OUT/iter_0000000 (iteration 0: a converted checkpoint has trained no step) and
// OUT/latest_checkpointed_iteration.txt in the sharded format, one rank file per rank of
// `target` (train/layout_writer.h), weights only: no optimizer state. The metadata holds
// the run fields at zero (iteration, consumed samples, FLOPs), rng_seed 1234, "args" (the
// model flags, the tokenizer's, make-vocab-size-divisible-by and the target sizes, as
// --use-checkpoint-args reads them), the tokenizer, vocab_size and padded_vocab_size,
// "optimizer_state": false, "hf_config" (config.json) and "converted_from".
// The tokenizer: tokenizer.json (+ tokenizer_config.json, special_tokens_map.json) when
// Megaton's HuggingFaceTokenizer reads it, else tokenizer.model (SentencePieceTokenizer),
// copied to OUT/tokenizer/; with neither, NullTokenizer with config.json's vocabulary
// (a warning). The vocabulary is the tokenizer's; the embedding (and output layer) rows
// are cut or zero-padded to it padded to make_vocab_size_divisible_by x TP (Megatron).
// Everything is written under OUT.tmp<PID> and renamed to OUT at the end; on any error
// the temporary directory is removed. Throws megaton::Error with one line naming the file,
// key or tensor for: OUT not empty, a missing or malformed config.json, an unsupported
// model, no or unreadable safetensors files, a dtype other than BF16/F16/F32, a missing
// tensor, a tensor the model does not use (other than rotary_emb.inv_freq and the MTP
// layers of DeepSeek-V3 and NemotronH), a shape that does not match config.json, a layout
// the model does not split into. config.json may hold Python's Infinity / NaN (read as
// null).
void import_hf_checkpoint(const HFImportOptions& options, const ConvertLog& log);

// The options of `megaton convert --load CKPT --to hf OUT`.
struct HFExportOptions {
  std::string load_dir;       // a Megaton checkpoint directory (the tracker's iteration)
  std::string out_dir;        // OUT: absent or an empty directory
  DType dtype = DType::BF16;  // --export-dtype bf16 | fp32
  int64_t max_shard_bytes = 5'000'000'000;  // --max-shard-size (HF's default 5GB)
};

// Reads the checkpoint's model tensors (either format, any layout) and args, and writes a
// Hugging Face directory: config.json (train/hf_config.h's family rule), model.safetensors
// (or model-0000i-of-0000N.safetensors and model.safetensors.index.json when the tensors
// pass max_shard_bytes) with metadata {"format": "pt"}, the vocabulary rows trimmed to the
// real vocabulary (metadata "vocab_size"), and the run's tokenizer files when present
// (tokenizer.json, tokenizer_config.json, special_tokens_map.json; tokenizer.model;
// vocab.json and merges.txt). Optimizer state is not read. Written under OUT.tmp<PID> and
// renamed at the end. config.json's fields the model flags do not determine
// (HFExport::carried_keys) come from the source model's config.json when the checkpoint
// was converted from one of the same family. Throws megaton::Error with one line for OUT
// not empty, a checkpoint that is missing or has no args, a model Hugging Face's families
// cannot express (naming the flag), a missing tensor or one without a counterpart.
void export_hf_checkpoint(const HFExportOptions& options, const ConvertLog& log);

}  // namespace megaton
