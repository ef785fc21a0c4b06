//! Kilosort4 preprocessing: channel mean, median CAR, FFT high-pass, local whitening.
