//! The `qinfer` command.

mod commands;
mod common;
mod hub;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "qinfer", version, about = "Inference engine for the Qwen family of language models")]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// The widest CPU kernels to use: auto (the best this CPU has: AVX-512
    /// VNNI, else AVX2), avx2, or portable (no SIMD); lower it to compare paths.
    #[arg(long, global = true, default_value = "auto", value_name = "auto|avx512|avx2|portable")]
    cpu_kernels: qinfer::backend::cpu::simd::CpuKernels,
    /// Where the model runs: cpu, cuda or cuda:N (CUDA needs a `--features cuda` build).
    #[arg(long, global = true, default_value = "cpu")]
    device: qinfer::loader::Device,
    /// Run every CUDA decode step as it comes instead of replaying recorded
    /// CUDA graphs (debugging; same results, slower).
    #[arg(long, global = true)]
    no_cuda_graphs: bool,
    /// Launch each CUDA kernel only once the one before it has finished,
    /// instead of letting it be scheduled (and read weights) while that one
    /// finishes (measuring the overlap; same results, slower).
    #[arg(long, global = true)]
    no_overlapped_launches: bool,
    /// How KV caches store keys and values. On the CPU (default f32): f32,
    /// f16, fp8, turbo8, turbo4, turbo3, turbo2, or k<K>v<V> for different
    /// key and value widths (e.g. k8v4; `4p` keys are TurboQuant_prod). On
    /// CUDA (default f16): f16 or f32.
    #[arg(long, global = true, value_name = "FORMAT")]
    kv_cache: Option<qinfer::kv::KvFormat>,
    /// Log level filter (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Chat-style answer to a prompt, streamed to stdout.
    Run(commands::run::Args),
    /// Raw continuation of tokens or text (no chat template).
    Generate(commands::generate::Args),
    /// Many requests from a JSONL file at once (continuous batching), results
    /// in input order.
    Batch(commands::batch::Args),
    /// Teacher-forced logits for a sequence, written as a .npy file.
    Score(commands::score::Args),
    /// Embeddings of texts from a JSONL file (an embedding model), as JSONL or .npy.
    Embed(commands::embed::Args),
    /// Perplexity of a text file (llama.cpp's llama-perplexity chunking).
    Perplexity(commands::perplexity::Args),
    /// OpenAI- and Anthropic-compatible HTTP server (continuous batching).
    Serve(commands::serve::Args),
    /// Prompt-processing and token-generation throughput (llama-bench style).
    Bench(commands::bench::Args),
    /// Architecture, shapes, dtypes, parameter count and file sizes.
    Inspect(commands::inspect::Args),
    /// Write an MLX affine-quantized or block-FP8 copy of a Hugging Face model.
    Quantize(commands::quantize::Args),
    /// Compile the CUDA kernels for a GPU architecture into the kernel cache
    /// (`QINFER_CACHE`, else ~/.cache/qinfer), ahead of the first run.
    Kernels(commands::kernels::Args),
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Some(n) = cli.threads
        && let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global()
    {
        eprintln!("error: could not start {n} threads: {e}");
        std::process::exit(2);
    }
    qinfer::backend::cpu::simd::limit_cpu_kernels(cli.cpu_kernels);
    let options = qinfer::loader::CudaOptions {
        graphs: !cli.no_cuda_graphs,
        overlapped_launches: !cli.no_overlapped_launches,
        ..Default::default()
    };
    let device =
        cli.device.with_cuda_options(options).and_then(|d| d.with_kv_format(cli.kv_cache)).unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2);
        });
    let result = match cli.command {
        Command::Run(a) => commands::run::main(a, device),
        Command::Generate(a) => commands::generate::main(a, device),
        Command::Batch(a) => commands::batch::main(a, device),
        Command::Score(a) => commands::score::main(a, device),
        Command::Embed(a) => commands::embed::main(a, device),
        Command::Perplexity(a) => commands::perplexity::main(a, device),
        Command::Bench(a) => commands::bench::main(a, device),
        Command::Serve(a) => commands::serve::main(a, device),
        Command::Inspect(a) => commands::inspect::main(a),
        Command::Quantize(a) => commands::quantize::main(a),
        Command::Kernels(a) => commands::kernels::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
