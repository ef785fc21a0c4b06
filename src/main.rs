//! The `spikecube` command line. All work is in the library; this only parses
//! flags, runs the subcommand and prints an error once (exit code 2).

mod cli;

use std::process::ExitCode;

/// Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid or not set" on every
/// adapter query when the variable is missing or invalid (servers, containers, cron). Give
/// them a private runtime folder before any thread starts, so that probing the GPU
/// back ends prints nothing.
#[cfg(all(unix, feature = "wgpu"))]
fn quiet_vulkan_probe() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if std::env::var_os("XDG_RUNTIME_DIR")
        .is_some_and(|d| !d.is_empty() && std::path::Path::new(&d).is_dir())
    {
        return;
    }
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("spikecube-runtime-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let ok = std::fs::metadata(&dir)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o777 == 0o700);
    if ok {
        // SAFETY: called first thing in main, before any other thread exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
    }
}

fn main() -> ExitCode {
    #[cfg(all(unix, feature = "wgpu"))]
    quiet_vulkan_probe();
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
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "spikecube: error: {line}");
            // `--json` asks for a machine-readable result: the error is one too.
            if std::env::args_os().any(|a| a == "--json") {
                let v = serde_json::json!({"error": line, "exit_code": 2});
                let _ = writeln!(std::io::stdout(), "{v}");
            }
            ExitCode::from(2)
        }
    }
}
