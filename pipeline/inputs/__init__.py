"""Where documents come from: the job file, discovery, PDFs, image sets, sample documents."""
