//! Reading windows on several threads, handed on in window order.
//!
//! One thread reading a 384-channel window (46 MB of int16) and then checking
//! it keeps a GPU waiting: both steps already run on the shared rayon pool,
//! but each ends in a join whose tail leaves cores idle, and the checks of a
//! window cannot start before its read ends. [`read_in_order`] lets several
//! threads each read a window of their own at once; each window then waits for
//! its turn and is handed on (checked, sent to the next stage) in window
//! order, one at a time, exactly as a single reading loop would hand it on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// Reads items `0..n` on `states.len()` threads (named `{name}-{k}`, each
/// with its own state `S`, e.g. its buffer allocator and busy seconds) and
/// hands them to `deliver` in item order.
///
/// * `take(i)`: the storage for item `i`, called in item order (`0, 1, 2,
///   …`) under a lock, so storage is claimed in the order items are handed on:
///   when `take` blocks until storage comes back (the bound on items in
///   flight), the item it waits for is always the earliest not yet read, and
///   no later item can hold storage it needs. `None` stops the run.
/// * `read(state, i, storage)`: on the thread that took item `i`, beside the
///   other threads' reads.
/// * `deliver(i, item)`: on the thread that read item `i`, once items `0..i`
///   have been delivered, one at a time (calls never overlap, and each sees
///   everything the earlier ones did: a caller's sums in item order come out
///   as in a sequential loop). `false` stops the run.
///
/// So items in flight are those `take` has handed out and `deliver` has not
/// yet taken: at most one per thread, plus whatever storage the caller's
/// `take` lets exist beyond that. Returns the threads' states when every item
/// was delivered or the run stopped.
///
/// # Errors
/// When a thread cannot be started (the threads started finish first; items
/// from the first one not delivered on are not).
///
/// # Panics
/// When a thread panics in `take`, `read` or `deliver`, the others stop at
/// their next item and the panic goes on from here.
pub fn read_in_order<S, B, T, Take, Read, Deliver>(
    name: &str,
    n: u64,
    states: Vec<S>,
    take: Take,
    read: Read,
    deliver: Deliver,
) -> std::io::Result<Vec<S>>
where
    S: Send,
    Take: FnMut(u64) -> Option<B> + Send,
    Read: Fn(&mut S, u64, B) -> T + Sync,
    Deliver: FnMut(u64, T) -> bool + Send,
{
    let shared = Shared {
        source: Mutex::new((0, take)),
        turn: Mutex::new((0, deliver)),
        turn_moved: Condvar::new(),
        stop: AtomicBool::new(false),
    };
    let shared = &shared;
    let read = &read;
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(states.len());
        let mut spawn_error = None;
        for (k, state) in states.into_iter().enumerate() {
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{k}"))
                .spawn_scoped(s, move || shared.work(n, state, read));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    shared.stop();
                    spawn_error = Some(e);
                    break;
                }
            }
        }
        let mut out = Vec::with_capacity(handles.len());
        let mut panic = None;
        for h in handles {
            match h.join() {
                Ok(state) => out.push(state),
                Err(p) => panic = Some(p),
            }
        }
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        match spawn_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })
}

struct Shared<Take, Deliver> {
    /// The next item to hand out, and the storage for it.
    source: Mutex<(u64, Take)>,
    /// The next item to deliver, and where to.
    turn: Mutex<(u64, Deliver)>,
    turn_moved: Condvar,
    stop: AtomicBool,
}

fn relock<G>(r: std::sync::LockResult<G>) -> G {
    // A poisoned lock means another thread panicked; it has set `stop` (or
    // will, unwinding), which every loop checks.
    r.unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<Take, Deliver> Shared<Take, Deliver> {
    /// Stops every thread at its next item (set under the turn's lock, so that
    /// no thread waiting for its turn misses it).
    fn stop(&self) {
        let guard: MutexGuard<'_, _> = relock(self.turn.lock());
        self.stop.store(true, Ordering::SeqCst);
        drop(guard);
        self.turn_moved.notify_all();
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// One reading thread: take the next item, read it, wait for its turn,
    /// deliver it; until the items run out or the run stops.
    fn work<S, B, T, Read>(&self, n: u64, mut state: S, read: &Read) -> S
    where
        Take: FnMut(u64) -> Option<B>,
        Read: Fn(&mut S, u64, B) -> T,
        Deliver: FnMut(u64, T) -> bool,
    {
        /// Stops the others when this thread unwinds.
        struct OnPanic<'a, Take, Deliver>(&'a Shared<Take, Deliver>);
        impl<Take, Deliver> Drop for OnPanic<'_, Take, Deliver> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.stop();
                }
            }
        }
        let _on_panic = OnPanic(self);
        loop {
            let (i, storage) = {
                let mut source = relock(self.source.lock());
                if source.0 >= n || self.stopped() {
                    break;
                }
                let i = source.0;
                match (source.1)(i) {
                    Some(b) => {
                        source.0 += 1;
                        (i, b)
                    }
                    None => {
                        drop(source);
                        self.stop();
                        break;
                    }
                }
            };
            let item = read(&mut state, i, storage);
            let mut turn = relock(self.turn.lock());
            while turn.0 != i && !self.stopped() {
                turn = relock(self.turn_moved.wait(turn));
            }
            if self.stopped() {
                break;
            }
            let go_on = (turn.1)(i, item);
            turn.0 += 1;
            if !go_on {
                self.stop.store(true, Ordering::SeqCst);
            }
            drop(turn);
            self.turn_moved.notify_all();
            if !go_on {
                break;
            }
        }
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn items_are_delivered_in_order_with_storage_taken_in_order() {
        for threads in [1, 2, 3, 5] {
            let mut taken = Vec::new();
            let mut delivered = Vec::new();
            let states = read_in_order(
                "test-read",
                50,
                vec![0u64; threads],
                |i| {
                    taken.push(i);
                    Some(i * 10)
                },
                |count: &mut u64, i, b| {
                    *count += 1;
                    // Uneven read times, so that later items finish first.
                    std::thread::sleep(std::time::Duration::from_micros((50 - i) * 20 % 300));
                    (i, b)
                },
                |i, item| {
                    assert_eq!(item, (i, i * 10));
                    delivered.push(i);
                    true
                },
            )
            .unwrap();
            let all: Vec<u64> = (0..50).collect();
            assert_eq!(taken, all, "{threads} threads");
            assert_eq!(delivered, all, "{threads} threads");
            assert_eq!(states.iter().sum::<u64>(), 50);
        }
    }

    #[test]
    fn items_in_flight_stay_within_the_storage_given() {
        // Storage is a token returned once its item is delivered: at most
        // `tokens` items are between `take` and `deliver`.
        let (tx, rx) = crossbeam_channel::bounded::<()>(3);
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
        let in_flight = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let mut delivered = 0;
        read_in_order(
            "test-read",
            40,
            vec![(); 4],
            |_| {
                let t = rx.recv().ok();
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                t
            },
            |_, i, ()| {
                std::thread::sleep(std::time::Duration::from_micros(200));
                i
            },
            |i, item| {
                assert_eq!(i, item);
                delivered += 1;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                tx.send(()).unwrap();
                true
            },
        )
        .unwrap();
        assert_eq!(delivered, 40);
        assert!(peak.load(Ordering::SeqCst) <= 3);
    }

    #[test]
    fn a_refused_delivery_or_storage_stops_every_thread() {
        let mut delivered = Vec::new();
        read_in_order(
            "test-read",
            1000,
            vec![(); 3],
            Some,
            |_, i, _| i,
            |i, _| {
                delivered.push(i);
                i < 6
            },
        )
        .unwrap();
        assert_eq!(delivered, (0..=6).collect::<Vec<_>>());

        let mut delivered = Vec::new();
        read_in_order(
            "test-read",
            1000,
            vec![(); 3],
            |i| (i < 4).then_some(i),
            |_, i, _| i,
            |i, _| {
                delivered.push(i);
                true
            },
        )
        .unwrap();
        // Items taken before the refusal may or may not be delivered, but
        // always in order from 0.
        assert!(delivered.len() <= 4);
        assert_eq!(delivered, (0..delivered.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn a_panicking_reader_stops_the_others_and_panics_here() {
        let r = std::panic::catch_unwind(|| {
            read_in_order(
                "test-read",
                100,
                vec![(); 3],
                Some,
                |_, i, _| {
                    if i == 5 {
                        panic!("read failed at 5");
                    }
                    i
                },
                |_, _| true,
            )
        });
        assert!(r.is_err());
    }
}
