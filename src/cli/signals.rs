//! Ctrl-C and SIGTERM: stop at once, remove the unfinished output, say so in one
//! line and exit 130 (SIGINT) or 143 (SIGTERM), as shells expect.

/// Installs the handler: a thread that waits for SIGINT or SIGTERM, removes
/// every staged output folder of this process
/// ([`spikecube::output::folder::abandon_all`]) and exits.
#[cfg(unix)]
pub fn install() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        tracing::debug!(
            "cannot install the SIGINT/SIGTERM handler; interrupts stop without cleaning up"
        );
        return;
    };
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let removed = spikecube::output::folder::abandon_all();
            let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
            let list = |paths: &[std::path::PathBuf]| {
                let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
                names.join(", ")
            };
            let mut what = if removed.unfinished.is_empty() {
                "nothing unfinished was left".to_string()
            } else {
                format!("removed the unfinished {}", list(&removed.unfinished))
            };
            if !removed.parents.is_empty() {
                what.push_str(&format!(
                    " and the empty folders it had made for it, {}",
                    list(&removed.parents)
                ));
            }
            // Start on a fresh line when a progress bar is drawn on a terminal.
            let clear = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                "\r\x1b[2K"
            } else {
                ""
            };
            tell!("{clear}spikecube: interrupted ({name}); {what}");
            std::process::exit(128 + sig);
        }
    });
}

/// No signal handling off Unix: Ctrl-C ends the process; the `.partial-<pid>`
/// folder it leaves never looks like a finished result.
#[cfg(not(unix))]
pub fn install() {}
