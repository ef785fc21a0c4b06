//! Where compiled GPU kernels are kept (`SPIKECUBE_KERNEL_CACHE`): a folder
//! given is made and used, `off` turns the cache off, and a folder that cannot
//! be made is skipped rather than failing the run; and every CUDA client a
//! run makes takes its device from `backend::cuda_device`, which points
//! CubeCL's cache there before CubeCL reads its configuration (once, at the
//! first client: a client made before would leave every kernel compiled
//! again on every run). One test, so that the variable changes in one
//! thread only.

use spikecube::backend::kernel_cache_dir;

#[test]
fn kernel_cache_follows_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kernels");
    // SAFETY: this test binary has one test; nothing else reads the environment meanwhile.
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", &dir) };
    assert_eq!(kernel_cache_dir(), Some(dir.clone()));
    assert!(dir.is_dir());
    #[cfg(feature = "cuda")]
    {
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
        // No GPU needed: naming the device sets the configuration only.
        let _ = spikecube::backend::cuda_device();
        let cache = CubeClRuntimeConfig::get().compilation.cache.clone();
        assert_eq!(cache.map(|c| c.root()), Some(dir.clone()));
    }
    // No CUDA device is named anywhere else in the sources.
    let mut named = Vec::new();
    let mut stack = vec![std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for _ in text.matches("CudaDevice::new(") {
                    named.push(p.clone());
                }
            }
        }
    }
    assert_eq!(
        named.len(),
        1,
        "CudaDevice::new outside backend::cuda_device: {named:?}"
    );
    assert!(named[0].ends_with("src/backend.rs"), "{named:?}");
    // The write test leaves nothing behind.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", "off") };
    assert_eq!(kernel_cache_dir(), None);
    // A path under a plain file cannot be a folder.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", file.join("kernels")) };
    assert_eq!(kernel_cache_dir(), None);
    unsafe { std::env::remove_var("SPIKECUBE_KERNEL_CACHE") };
}
