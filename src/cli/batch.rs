//! `spikecube batch`: many recordings as independent tasks for a job engine
//! (Slurm arrays, Snakemake). `plan` writes the run folder's manifest once,
//! `task` runs one line of it, `collect` summarises them
//! ([`spikecube::batch`]).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Parser;
use spikecube::batch::{self, State, Task, Written};

/// Subcommands of `batch`.
#[derive(Debug, clap::Subcommand)]
pub enum Args {
    /// Write RUN/manifest.tsv: one task per recording (written once).
    ///
    /// Usage: spikecube batch plan INPUTS… --out RUN [--command detect|sort] [flags…]
    ///
    /// The recordings are the arguments before the first flag; every flag but
    /// --out and --command goes to each task's `spikecube detect` (the
    /// default) or `spikecube sort` (--probe included), and is checked now
    /// against each recording (its metadata, not its data) and the probe, as
    /// the task checks it before reading the data. Tasks write
    /// RUN/out/<name>/ (a sort's Phy folder).
    #[command(disable_help_flag = true)]
    Plan {
        /// INPUTS… --out RUN [detect flags…]
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            required = true,
            value_name = "INPUTS… --out RUN [FLAGS…]"
        )]
        args: Vec<OsString>,
    },
    /// Run line N of RUN/manifest.tsv into RUN/out/<name>/; skipped when that
    /// output is complete with the same settings.
    ///
    /// Uses the GPU the job engine hands it (CUDA_VISIBLE_DEVICES); on Slurm:
    /// --index $SLURM_ARRAY_TASK_ID.
    Task {
        /// The run folder (holding manifest.tsv).
        run: PathBuf,
        /// The manifest line's index, from 0.
        #[arg(long)]
        index: usize,
    },
    /// Write RUN/summary.tsv (per task: spikes, × realtime, warnings, device,
    /// host); exit non-zero naming each task that failed or is missing.
    Collect {
        /// The run folder (holding manifest.tsv).
        run: PathBuf,
    },
}

/// The command line of one task, parsed as the main command line would be.
#[derive(Debug, Parser)]
#[command(name = "spikecube", no_binary_name = true)]
struct LineCli {
    #[command(subcommand)]
    command: LineCommand,
}

#[derive(Debug, clap::Subcommand)]
// Parsed once per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum LineCommand {
    Detect(super::detect::Args),
    Sort(super::sort::Args),
}

/// Parses a task's command line; a bad flag is an error naming the task.
fn parse_line(argv: Vec<OsString>, what: &str) -> Result<LineCommand> {
    match LineCli::try_parse_from(argv) {
        Ok(c) => Ok(c.command),
        Err(e) => {
            let msg = e.render().to_string();
            let msg = msg.trim().trim_start_matches("error: ");
            bail!("{what}: {msg}")
        }
    }
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    match args {
        Args::Plan { args } => plan(args, quiet),
        Args::Task { run, index } => task(run, index, quiet),
        Args::Collect { run } => collect(run, quiet),
    }
}

fn plan(mut args: Vec<OsString>, quiet: bool) -> Result<ExitCode> {
    // The global -q / -v given after `plan` are the plan's own, not task flags.
    let quiet = quiet || args.iter().any(|a| a == "-q" || a == "--quiet");
    args.retain(|a| !["-q", "--quiet", "-v", "--verbose"].iter().any(|f| a == f));
    if args.iter().any(|a| a == "--help" || a == "-h") {
        use clap::CommandFactory;
        let mut cmd = super::Cli::command();
        let help = cmd
            .find_subcommand_mut("batch")
            .and_then(|b| b.find_subcommand_mut("plan"))
            .map(|p| p.render_long_help().to_string())
            .unwrap_or_default();
        say!("{help}");
        return Ok(ExitCode::SUCCESS);
    }
    let command = take_command(&mut args)?;
    let split = batch::split_args(&args)?;
    let manifest = batch::manifest_for(&command, &split)?;
    // Every line's flags are checked now, not when the tasks run: their
    // syntax, then their values against the line's recording and probe, as
    // the task will check them before it reads any sample.
    for line in &manifest.lines {
        let argv = line.argv(&split.run);
        // `detect --help` or `--version` would print and exit from inside the check.
        if line
            .flags
            .iter()
            .any(|f| ["--help", "-h", "--version", "-V"].contains(&f.as_str()))
        {
            bail!("--help and --version are not task flags");
        }
        let what = format!("task {} ({})", line.index, line.name);
        let checked = match parse_line(argv, &what)? {
            LineCommand::Detect(args) => super::detect::check(&args),
            LineCommand::Sort(args) => super::sort::check(&args),
        };
        // The recording is named once: many of the checks' messages name it.
        let input = line.inputs[0].display().to_string();
        let named = |m: &str| {
            if m.contains(&input) {
                what.clone()
            } else {
                format!("{what}, {input}")
            }
        };
        let warnings = checked.map_err(|e| {
            let context = named(&format!("{e:#}"));
            e.context(context)
        })?;
        // What the task would warn about before reading samples (a probe
        // made for more channels than the file, millimetre coordinates, …)
        // is said now too; the task's log says it again.
        for w in warnings {
            tracing::warn!("{}: {w}", named(&w));
        }
    }
    let written = batch::write_once(&split.run, &manifest)?;
    let path = split.run.join(batch::MANIFEST_TSV);
    let n = manifest.lines.len();
    if !quiet {
        for l in &manifest.lines {
            say!("{}\t{}\t{}", l.index, l.name, l.inputs[0].display());
        }
        let what = match written {
            Written::New => "written",
            Written::Unchanged => "already there, unchanged",
        };
        tell!(
            "spikecube: {} {what}: {n} task{} (indices 0–{}); outputs go to {}",
            path.display(),
            if n == 1 { "" } else { "s" },
            n.saturating_sub(1),
            split.run.join("out").display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Takes `--command NAME` (or `--command=NAME`) out of the plan's arguments:
/// the subcommand every task runs, `detect` when not given.
fn take_command(args: &mut Vec<OsString>) -> Result<String> {
    let mut command = None;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_string_lossy().into_owned();
        let value = if a == "--command" {
            let Some(v) = args.get(i + 1) else {
                bail!("--command needs a value: detect or sort");
            };
            let v = v.to_string_lossy().into_owned();
            args.drain(i..i + 2);
            v
        } else if let Some(v) = a.strip_prefix("--command=") {
            let v = v.to_string();
            args.remove(i);
            v
        } else {
            i += 1;
            continue;
        };
        if command.replace(value).is_some() {
            bail!("--command is given twice");
        }
    }
    let command = command.unwrap_or_else(|| "detect".into());
    if !batch::manifest::COMMANDS.contains(&command.as_str()) {
        bail!(
            "--command {command}: a task runs one of {}",
            batch::manifest::COMMANDS.join(", ")
        );
    }
    Ok(command)
}

fn task(run: PathBuf, index: usize, quiet: bool) -> Result<ExitCode> {
    let task = Task::load(&run, index)?;
    let what = format!("task {index} ({})", task.line.name);
    if let State::Complete(_) = task.state {
        task.record_outcome(None)?;
        say!(
            "spikecube: {what}: skipped: {} is complete with the same settings (hash {})",
            task.out.display(),
            task.provenance.settings_hash
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !quiet {
        let line: Vec<String> = task
            .argv()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        tell!(
            "spikecube: {what} on {}, CUDA_VISIBLE_DEVICES={}: spikecube {}",
            spikecube::provenance::host_name().unwrap_or_else(|| "?".into()),
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "(unset)".into()),
            shlex::try_join(line.iter().map(String::as_str)).unwrap_or_else(|_| line.join(" "))
        );
    }
    let result = match parse_line(task.argv(), &what) {
        Ok(LineCommand::Detect(args)) => {
            super::detect::run_task(args, quiet, Some(task.provenance.clone()))
        }
        Ok(LineCommand::Sort(args)) => {
            super::sort::run_task(args, quiet, Some(task.provenance.clone()))
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(code) => {
            task.record_outcome(None)?;
            Ok(code)
        }
        Err(e) => {
            // The whole chain, once, as the main error line prints it.
            let mut line = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !line.contains(&c) {
                    line = format!("{line}: {c}");
                }
            }
            let _ = task.record_outcome(Some(&line));
            Err(e.context(format!("{what} failed")))
        }
    }
}

fn collect(run: PathBuf, quiet: bool) -> Result<ExitCode> {
    let rows = batch::collect(&run)?;
    let summary = run.join(batch::SUMMARY_TSV);
    let bad: Vec<&batch::Row> = rows.iter().filter(|r| !r.ok()).collect();
    if !quiet {
        for r in rows.iter().filter(|r| r.ok()) {
            let j = r.json.as_ref().unwrap_or(&serde_json::Value::Null);
            say!(
                "ok\t{}\t{}\t{} spikes\t{}\t{}",
                r.index,
                r.name,
                j["counts"]["n_spikes"],
                j["provenance"]["device"].as_str().unwrap_or("?"),
                j["provenance"]["host"].as_str().unwrap_or("?")
            );
        }
    }
    for r in &bad {
        tell!(
            "spikecube: task {} ({}) {}: {}",
            r.index,
            r.name,
            r.status,
            r.problem
        );
    }
    if !bad.is_empty() {
        let names: Vec<String> = bad
            .iter()
            .map(|r| format!("{} ({})", r.index, r.name))
            .collect();
        bail!(
            "{} of {} tasks are not done: {}; {} lists them (run each again with `spikecube batch task {} --index N`)",
            bad.len(),
            rows.len(),
            names.join(", "),
            summary.display(),
            run.display()
        );
    }
    if !quiet {
        tell!(
            "spikecube: all {} tasks done; summary in {}",
            rows.len(),
            summary.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
