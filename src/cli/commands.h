// The `megaton` subcommands; each registers itself on the top-level CLI11 app.
#pragma once
#include <CLI/CLI.hpp>

namespace megaton::cli {

// Each add_*_command registers a subcommand whose callback does the work and throws
// megaton::Error for bad user input (main prints it on one line and exits with 2).
void add_train_command(CLI::App& app);       // cli/cmd_train.cpp
void add_generate_command(CLI::App& app);    // cli/cmd_generate.cpp
void add_preprocess_command(CLI::App& app);  // cli/cmd_preprocess.cpp
void add_tokenizer_command(CLI::App& app);   // cli/cmd_tokenizer.cpp
void add_convert_command(CLI::App& app);     // cli/cmd_convert.cpp

}  // namespace megaton::cli
