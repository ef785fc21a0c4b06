//! The `spikecube` command line. All work is in the library; this only parses
//! flags, runs the subcommand and prints an error once (exit code 2).

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::run() {
        Ok(code) => code,
        Err(err) => {
            // A closed pipe (e.g. `| head`) is not an error.
            if err
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            // Each cause once: error messages here often already name their cause.
            let mut line = err.to_string();
            for cause in err.chain().skip(1) {
                let c = cause.to_string();
                if !line.contains(&c) {
                    line = format!("{line}: {c}");
                }
            }
            eprintln!("spikecube: error: {line}");
            ExitCode::from(2)
        }
    }
}
