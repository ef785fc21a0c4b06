n_channels_dat = 33
offset = 0
sample_rate = 30000.0
dtype = 'int16'
hp_filtered = False
dat_path = ['sim_g0_t0.imec0.ap.bin']
