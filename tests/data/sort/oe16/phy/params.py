n_channels_dat = 16
offset = 0
sample_rate = 40000.0
dtype = 'int16'
hp_filtered = False
dat_path = ['continuous.dat']
