//! Subcommands, one file each. Flags are kebab-case versions of Kilosort4's setting names.

/// `println!` that never panics and never stops the run: a closed standard
/// output (`spikecube detect … | head -1`) is ignored.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// `eprintln!` that does not panic when standard error is closed (e.g.
/// `spikecube detect … 2>&1 | head -1`): the run goes on and finishes.
macro_rules! tell {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod batch;
mod common;
mod detect;
mod detect_window;
mod drift;
mod export_phy;
mod info;
mod preprocess;
mod probe;
mod shown;
mod signals;
mod simulate;
mod sort;
mod templates;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kilosort4's universal-template spike detection for high-density probes.
#[derive(Debug, Parser)]
#[command(name = "spikecube", version, about, long_about = None)]
pub struct Cli {
    /// Log less (warnings and errors only).
    #[arg(short, long, global = true)]
    quiet: bool,
    /// Log more (debug messages, with the module that wrote each line).
    #[arg(short, long, global = true, conflicts_with = "quiet")]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
// Parsed once per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Detect spikes in a recording (SpikeGLX, Open Ephys or flat binary) and write them to a folder.
    Detect(detect::Args),
    /// Sort a recording into units (Kilosort4's whole sort) and write a Phy folder.
    Sort(sort::Args),
    /// Detect spikes in one whitened window stored as .npy (channels × samples, float32).
    DetectWindow(detect_window::Args),
    /// Preprocess a recording as Kilosort4 does and write the whitened data (temp_wh.dat).
    Preprocess(preprocess::Args),
    /// Report what detection makes of a probe layout (centres, neighbourhoods, warnings).
    Probe(probe::Args),
    /// Write a synthetic SpikeGLX-style recording with ground-truth spikes.
    Simulate(simulate::Args),
    /// List the back ends this build has and the devices each finds.
    Info,
    /// Merges and Phy folder from Kilosort4's own sort arrays (for checks against Kilosort4).
    #[command(hide = true)]
    ExportPhy(export_phy::Args),
    /// Many recordings as tasks for a job engine (Slurm, Snakemake): plan, task, collect.
    #[command(subcommand)]
    Batch(batch::Args),
}

/// Parses the command line and runs the subcommand.
pub fn run() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    signals::install();
    // Warnings are not progress: -q hides progress and information only.
    let level = if cli.quiet {
        "warn"
    } else if cli.verbose {
        "debug"
    } else {
        "info"
    };
    // A filter from the environment (SPIKECUBE_LOG, else RUST_LOG) or -v is for
    // debugging: lines then name the module that wrote them.
    let env_filter = tracing_subscriber::EnvFilter::try_from_env("SPIKECUBE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env());
    let show_target = cli.verbose || env_filter.is_ok();
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // A closed standard error (`… 2>&1 | head`) is not an error to
        // report (tracing-subscriber would report it with a panicking
        // eprintln).
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(show_target);
    // Debugging lines also carry the seconds since the start, so that the
    // gaps between stages show.
    use tracing_subscriber::Layer as _;
    let layer = if show_target {
        layer
            .with_timer(tracing_subscriber::fmt::time::Uptime::default())
            .boxed()
    } else {
        layer.without_time().boxed()
    };
    let _ = tracing_subscriber::registry()
        .with(env_filter.unwrap_or_else(|_| {
            // The GPU libraries' own info lines (adapter dumps) are for debugging.
            tracing_subscriber::EnvFilter::new(format!(
                "{level},cubecl_wgpu=warn,cubecl_cuda=warn,cubecl_runtime=warn,wgpu_core=warn,wgpu_hal=warn,naga=warn"
            ))
        }))
        .with(layer)
        .with(shown::WarningsShown)
        .try_init();
    tracing::debug!("spikecube {} started", env!("CARGO_PKG_VERSION"));
    let done = match cli.command {
        Command::Detect(args) => detect::run(args, cli.quiet),
        Command::Sort(args) => sort::run(args, cli.quiet),
        Command::DetectWindow(args) => detect_window::run(args),
        Command::Preprocess(args) => preprocess::run(args, cli.quiet),
        Command::Probe(args) => probe::run(args),
        Command::Simulate(args) => simulate::run(args, cli.quiet),
        Command::Info => info::run(),
        Command::ExportPhy(args) => export_phy::run(args, cli.quiet),
        Command::Batch(args) => batch::run(args, cli.quiet),
    };
    tracing::debug!("spikecube: the command returned; the process ends");
    done
}
