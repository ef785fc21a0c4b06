//! The reading thread's work per window: reading a window as int16
//! rows (the GPU back ends' path), the input checks on those rows, reading it
//! as f32 (the CPU back end's path) and the checks on the f32 window, each
//! timed alone, per window, with rayon pools of the given sizes. Prints the
//! median milliseconds per window of each step and of read + checks.
//!
//! Then the whole reading stage of a GPU pass: the int16 reads on
//! 1, 2 or 3 threads at once, checked in window order
//! (`recording::read_in_order`), wall and CPU ms per window.
//!
//! Usage: `cargo bench --bench read_window -- REC [PROBE] [--threads 1,2]
//! [--windows N] [--reps R]`
//!
//! * `REC`: a SpikeGLX `.bin` with its `.meta` (e.g. from `spikecube simulate
//!   --seconds 60 --out DIR`); `PROBE`: a probe file, when the `.meta` does not
//!   give the geometry;
//! * `--threads`: pool sizes, comma-separated (default: 1 and every core);
//! * `--windows`: windows read per repetition, spread over the recording
//!   (default: all; the first and last are always among them);
//! * `--reps`: repetitions over those windows (default 3; the medians are over
//!   all windows of all repetitions, after one warm-up read of each).
//!
//! The windows use Kilosort4's defaults (`batch_size` 60 000, `nt` 61). The
//! checks are those of `spikecube detect`: stuck runs (1 ms), channel health
//! over the own samples, stuck runs masked. On the 16-core machine: build with
//! `cargo bench --bench read_window --no-run`, then run the printed binary with
//! the same arguments. Keep the file in the page cache (read it once first):
//! this measures the CPU's work, not the disk.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ndarray::Array2;
use spikecube::Probe;
use spikecube::checks::{ChannelHealth, WindowColumns, check_window, stuck_min_run};
use spikecube::recording::{
    OpenOptions, Raw16, Window, WindowPlan, open, read_window, read_window_i16,
};

mod common;
use common::median;

struct Args {
    rec: PathBuf,
    probe: Option<PathBuf>,
    threads: Vec<usize>,
    windows: Option<u64>,
    reps: usize,
}

fn parse_args() -> Result<Args> {
    let mut pos = Vec::new();
    let mut threads = Vec::new();
    let mut windows = None;
    let mut reps = 3;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            // cargo bench passes --bench to harness-less targets.
            "--bench" => {}
            "--threads" => {
                let v = it.next().context("--threads needs a list, e.g. 1,2")?;
                for t in v.split(',') {
                    threads.push(t.trim().parse().context("--threads: a number")?);
                }
            }
            "--windows" => {
                windows = Some(it.next().context("--windows N")?.parse()?);
            }
            "--reps" => reps = it.next().context("--reps R")?.parse()?,
            _ if a.starts_with("--") => bail!("unknown option {a}"),
            _ => pos.push(PathBuf::from(a)),
        }
    }
    if threads.is_empty() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        threads = if n > 1 { vec![1, n] } else { vec![1] };
    }
    let mut pos = pos.into_iter();
    let rec = pos
        .next()
        .context("usage: read_window REC [PROBE] [--threads 1,2] [--windows N] [--reps R]")?;
    Ok(Args {
        rec,
        probe: pos.next(),
        threads,
        windows,
        reps: reps.max(1),
    })
}

fn window(plan: &WindowPlan, first: u64, i: u64, data: Array2<f32>, raw: Option<Raw16>) -> Window {
    let own_start = first + plan.window_start(i);
    Window {
        index: i,
        own_start,
        own_len: plan.own_len(i),
        first_sample: own_start as i64 - plan.nt as i64,
        data,
        raw16: raw,
    }
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let opened = open(&args.rec, &OpenOptions::default())?;
    let probe: Probe = match (&args.probe, opened.probe) {
        (Some(p), _) => Probe::load(p)?,
        (None, Some(p)) => p,
        (None, None) => bail!("the recording's metadata gives no probe: give PROBE"),
    };
    let rec = opened.recording;
    let chan_map = probe.chan_map.clone();
    let plan = WindowPlan::new(rec.n_samples(), 60_000, 61)?;
    let nw = plan.n_windows;
    if nw == 0 {
        bail!("the recording is shorter than one window");
    }
    let k = args.windows.unwrap_or(nw).clamp(1, nw);
    // k windows spread evenly, the first and the last among them.
    let mut indices: Vec<u64> = (0..k)
        .map(|j| if k == 1 { 0 } else { j * (nw - 1) / (k - 1) })
        .collect();
    indices.dedup();
    let min_run = stuck_min_run(rec.fs());
    let (rows, n) = (chan_map.len(), plan.window_len());
    let stride = Raw16::stride_for(n);
    let first = rec.first_sample();
    println!(
        "{}: {} windows of {rows} rows × {n} samples ({:.1} MB int16 per window); {} timed per repetition, {} repetitions; commit {}",
        rec.describe(),
        nw,
        (rows * n * 2) as f64 / 1e6,
        indices.len(),
        args.reps,
        option_env!("SPIKECUBE_COMMIT").unwrap_or("(set SPIKECUBE_COMMIT at build)")
    );
    println!(
        "{:>7}  {:<20} {:>9} {:>9}   (ms per window, medians; cpu: the process's user + system time)",
        "threads", "step", "wall", "cpu"
    );
    const STEPS: [&str; 8] = [
        "read int16",
        "checks int16",
        "read + checks int16",
        "read f32",
        "checks f32",
        "read + checks f32",
        "transients int16",
        "checks+transients16",
    ];
    let gap = spikecube::checks::transients::transient_gap(rec.fs());
    for &t in &args.threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        // Per step: wall and CPU milliseconds of every timed window.
        let mut wall: [Vec<f64>; 8] = Default::default();
        let mut cpu: [Vec<f64>; 8] = Default::default();
        let mut stuck = 0u64;
        pool.install(|| -> Result<()> {
            let mut buf = vec![0i16; rows * stride];
            let mut data = Array2::<f32>::zeros((rows, n));
            for rep in 0..=args.reps {
                let mut health_i = ChannelHealth::new(&chan_map);
                let mut health_f = ChannelHealth::new(&chan_map);
                for &i in &indices {
                    let cols = WindowColumns::of(&plan, i);
                    let (t0, c0) = (Instant::now(), cpu_ms());
                    let mut raw = Raw16::new(rows, n, stride, Box::new(std::mem::take(&mut buf)))?;
                    if !read_window_i16(rec.as_ref(), &plan, i, &chan_map, &mut raw)? {
                        bail!("the recording does not give int16 values as they are");
                    }
                    let (t1, c1) = (Instant::now(), cpu_ms());
                    let mut w = window(&plan, first, i, Array2::zeros((0, 0)), Some(raw));
                    let runs_i = check_window(&mut w, &cols, min_run, Some(&mut health_i), true);
                    let (t2, c2) = (Instant::now(), cpu_ms());
                    let r16 = w.raw16.as_ref().expect("int16 window");
                    let shape = (r16.n_rows, r16.n_cols, r16.stride);
                    std::hint::black_box(spikecube::checks::transients::find_transients(
                        r16.values(),
                        shape,
                        gap,
                    ));
                    let (t2b, c2b) = (Instant::now(), cpu_ms());
                    // detect's checks of a window: both in one pass over it
                    // (again on the same window, only to time it).
                    std::hint::black_box(spikecube::checks::precheck_window_with_transients(
                        &mut w, &cols, min_run, true, gap,
                    ));
                    let (t2c, c2c) = (Instant::now(), cpu_ms());
                    read_window(rec.as_ref(), &plan, i, &chan_map, &mut data)?;
                    let (t3, c3) = (Instant::now(), cpu_ms());
                    let mut wf = window(&plan, first, i, std::mem::take(&mut data), None);
                    let runs_f = check_window(&mut wf, &cols, min_run, Some(&mut health_f), true);
                    let (t4, c4) = (Instant::now(), cpu_ms());
                    if runs_i != runs_f {
                        bail!("window {i}: the int16 and f32 checks disagree");
                    }
                    let raw = w.raw16.take().expect("int16 window");
                    buf = *raw
                        .into_buffer()
                        .downcast::<Vec<i16>>()
                        .expect("a Vec buffer");
                    data = wf.data;
                    if rep > 0 {
                        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
                        let spans = [
                            (0, 1),
                            (1, 2),
                            (0, 2),
                            (6, 3),
                            (3, 4),
                            (6, 4),
                            (2, 5),
                            (5, 6),
                        ];
                        let ts = [t0, t1, t2, t3, t4, t2b, t2c];
                        let cs = [c0, c1, c2, c3, c4, c2b, c2c];
                        for (k, &(a, b)) in spans.iter().enumerate() {
                            wall[k].push(ms(ts[a], ts[b]));
                            cpu[k].push(cs[b] - cs[a]);
                        }
                    }
                }
                if health_i.findings() != health_f.findings() {
                    bail!("the int16 and f32 channel findings disagree");
                }
                stuck = health_i.stuck_samples();
            }
            Ok(())
        })?;
        for (k, step) in STEPS.iter().enumerate() {
            println!(
                "{t:>7}  {step:<20} {:>9.2} {:>9.2}",
                median(std::mem::take(&mut wall[k])),
                median(std::mem::take(&mut cpu[k]))
            );
        }
        println!("{t:>7}  (stuck samples found over the timed windows: {stuck})");
    }
    pipelined(&args, rec.as_ref(), &plan, &chan_map, &indices)?;
    Ok(())
}

/// The reading stage as `run_windows` runs it for a GPU pass: int16
/// reads on 1, 2 or 3 threads at once (`recording::read_in_order`), the
/// checks in window order, each window's buffer given back as soon as it is
/// checked (a consumer that never waits), `readers + 1` buffers. Prints the
/// wall and CPU milliseconds per window over all timed windows (medians over
/// the repetitions), and checks that the channel findings equal the single
/// reader's.
fn pipelined(
    args: &Args,
    rec: &dyn spikecube::recording::Recording,
    plan: &WindowPlan,
    chan_map: &[u64],
    indices: &[u64],
) -> Result<()> {
    let min_run = stuck_min_run(rec.fs());
    let (rows, n) = (chan_map.len(), plan.window_len());
    let stride = Raw16::stride_for(n);
    let first = rec.first_sample();
    println!(
        "{:>7}  {:<20} {:>9} {:>9}   (whole reading stage: ms per window over {} windows, medians of {} repetitions)",
        "threads",
        "readers",
        "wall",
        "cpu",
        indices.len(),
        args.reps
    );
    for &t in &args.threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        let mut reference = None;
        for readers in [1usize, 2, 3] {
            let (mut wall, mut cpu) = (Vec::new(), Vec::new());
            pool.install(|| -> Result<()> {
                let (free_tx, free_rx) = crossbeam_channel::unbounded::<Vec<i16>>();
                for _ in 0..readers + 1 {
                    free_tx.send(vec![0i16; rows * stride])?;
                }
                for rep in 0..=args.reps {
                    let mut health = ChannelHealth::new(chan_map);
                    let mut error = None;
                    let (t0, c0) = (Instant::now(), cpu_ms());
                    spikecube::recording::read_in_order(
                        "bench-read",
                        indices.len() as u64,
                        vec![(); readers],
                        |_| free_rx.recv().ok(),
                        |_, k, buf| -> Result<Window> {
                            let i = indices[k as usize];
                            let mut raw = Raw16::new(rows, n, stride, Box::new(buf))?;
                            if !read_window_i16(rec, plan, i, chan_map, &mut raw)? {
                                bail!("the recording does not give int16 values as they are");
                            }
                            Ok(window(plan, first, i, Array2::zeros((0, 0)), Some(raw)))
                        },
                        |k, w| match w {
                            Ok(mut w) => {
                                let cols = WindowColumns::of(plan, indices[k as usize]);
                                check_window(&mut w, &cols, min_run, Some(&mut health), true);
                                let raw = w.raw16.take().expect("int16 window");
                                let buf = *raw
                                    .into_buffer()
                                    .downcast::<Vec<i16>>()
                                    .expect("a Vec buffer");
                                free_tx.send(buf).is_ok()
                            }
                            Err(e) => {
                                error = Some(e);
                                false
                            }
                        },
                    )?;
                    if let Some(e) = error {
                        return Err(e);
                    }
                    let per = indices.len() as f64;
                    if rep > 0 {
                        wall.push(t0.elapsed().as_secs_f64() * 1e3 / per);
                        cpu.push((cpu_ms() - c0) / per);
                    }
                    let found = health.findings();
                    match &reference {
                        None => reference = Some(found),
                        Some(r) if *r != found => {
                            bail!("{readers} readers: other channel findings than 1 reader's")
                        }
                        Some(_) => {}
                    }
                }
                Ok(())
            })?;
            println!(
                "{t:>7}  {:<20} {:>9.2} {:>9.2}",
                format!("{readers} reading threads"),
                median(wall),
                median(cpu)
            );
        }
    }
    Ok(())
}

/// CPU time of the whole process (all threads, user + system), ms.
fn cpu_ms() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: clock_gettime writes one timespec, which we own.
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 * 1e-6;
        }
    }
    f64::NAN
}
