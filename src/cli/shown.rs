//! The warnings already shown on standard error as they happened, so that a
//! run's closing list of warnings can leave them out under `-q` (where that
//! list would otherwise print each one a second time).

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

fn shown() -> &'static Mutex<HashSet<String>> {
    static SHOWN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    SHOWN.get_or_init(Default::default)
}

/// Records the message of every warning the log filter lets through.
pub struct WarningsShown;

struct Message(Option<String>);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = Some(value.to_string());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S: Subscriber> Layer<S> for WarningsShown {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() != Level::WARN {
            return;
        }
        let mut m = Message(None);
        event.record(&mut m);
        if let (Some(text), Ok(mut set)) = (m.0, shown().lock()) {
            set.insert(text);
        }
    }
}

/// The run's closing list of warnings: all of `warnings`, or under `quiet`
/// only those not already shown as they happened.
pub fn to_list(warnings: &[String], quiet: bool) -> Vec<&String> {
    let set = shown().lock().map(|s| s.clone()).unwrap_or_default();
    warnings
        .iter()
        .filter(|w| !quiet || !set.contains(*w))
        .collect()
}
